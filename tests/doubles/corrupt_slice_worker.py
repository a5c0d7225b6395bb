"""A worker that serves one corrupted expert to slice fetchers (a test double run as a real process).

Usage: python -m tests.doubles.corrupt_slice_worker worker [moeswarm worker options]
It is the real worker with one change: the first byte of every piece it serves is flipped, so each piece passes
every wire check and fails only the fetcher's hash against the model's leaf (its first answer gives it away).
"""

import dataclasses

from node.cli.root import main
from node.worker import slice_server

_honest = slice_server.SliceServer.piece


async def _corrupted(self, peer, req):
    piece = await _honest(self, peer, req)
    return dataclasses.replace(piece, data=bytes([piece.data[0] ^ 0xFF]) + piece.data[1:])


slice_server.SliceServer.piece = _corrupted

if __name__ == "__main__":
    main()
