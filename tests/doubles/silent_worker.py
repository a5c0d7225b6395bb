"""A worker that announces its experts and never answers a dispatch (a sybil, or a wedged host; a test double run as
a real process).

Usage: python -m tests.doubles.silent_worker worker [moeswarm worker options]
It is the real worker with one change: every dispatch waits forever before computing, so its records are valid, its
QUIC handshake succeeds, and the backbone only ever sees its own deadline pass.
"""

import asyncio

from node.cli.root import main
from node.worker import service as worker


async def _never(self, layer, x, ids, w, held):
    await asyncio.Event().wait()


worker.Worker._compute = _never

if __name__ == "__main__":
    main()
