"""A worker that answers dispatches with correct sums but never signs their receipts, or signs them with a key that
is not its own (a test double run as a real process).

Usage: python -m tests.doubles.unsigning_worker never|forge worker [moeswarm worker options]
It is the real worker with one change to the batch signature a backbone asks for after the replies: ``never`` leaves
the request unanswered (the backbone's deadline passes), ``forge`` answers the right leaves with a signature made by
a fresh key (it does not verify). Its ledger stays empty either way.
"""

import asyncio
import dataclasses
import sys

from node.cli.root import main
from node.ledger.receipts import batch_message, merkle_root
from node.worker import service as worker
from p2p.identity import Identity
from p2p.wire import messages as wire

MODE = sys.argv.pop(1)
_honest_sign, _honest_handle = worker.Worker._sign, worker.Worker.handle
_stranger = Identity.generate()


def _forged(self, peer, msg):
    batch = _honest_sign(self, peer, msg)
    return dataclasses.replace(batch, signature=_stranger.sign(batch_message(merkle_root(batch.leaves), len(batch.leaves))))


async def _never(self, peer, data):
    if wire.decode_header(data).msg_type == wire.MsgType.RECEIPT_SIGN_REQUEST:
        await asyncio.Event().wait()
    return await _honest_handle(self, peer, data)


if MODE == "never":
    worker.Worker.handle = _never
elif MODE == "forge":
    worker.Worker._sign = _forged
    worker.Worker._record = lambda self, receipts, stamps: None  # nothing recorded: the signature sent is not its own
else:
    raise SystemExit(f"mode must be never or forge, not {MODE}")

if __name__ == "__main__":
    main()
