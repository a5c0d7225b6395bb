"""The worker's in-flight caps, on its real handler (in process, the embedded model, no sockets): past them a
dispatch gets a wire ErrorReply OVERLOADED naming the limit; a peer with nothing in flight is still admitted."""

from __future__ import annotations

import asyncio

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from node.worker.service import Worker
from p2p.identity import Identity
from p2p.wire import messages as wire
from tests.support.engine import kernel
from tests.support.polling import run_bounded

from .test_floods import Valid

ALICE, BOB, CAROL = (Identity.generate().peer_id for _ in range(3))


def test_in_flight_caps_refuse_with_overloaded_and_spare_a_quiet_peer():
    """Per-peer cap 2, global cap 3, each dispatch held 1 s: Alice's third is OVERLOADED; with Alice and Bob filling
    the global cap, Bob's next is OVERLOADED but Carol's first is served; every served reply decodes."""
    model = GGUFModel(EMBEDDED_MODEL)
    valid = Valid(model, seed=3)
    worker = Worker(Identity.generate(), open_experts(model, kernel())[0], delay=1.0, max_in_flight=3, max_in_flight_per_peer=2)

    async def main() -> dict[str, list[str]]:
        async def send(peer) -> str:
            reply = wire.decode(await worker.handle(peer, valid.request))
            return reply.code.name if isinstance(reply, wire.ErrorReply) else type(reply).__name__

        held = [asyncio.ensure_future(send(p)) for p in (ALICE, ALICE, BOB)]
        await asyncio.sleep(0)  # the three are admitted (in flight) before the next ones arrive
        late = {name: await send(peer) for name, peer in (("alice", ALICE), ("bob", BOB))}
        carol = await send(CAROL)
        return {"held": list(await asyncio.gather(*held)), "late": list(late.values()), "carol": [carol]}

    try:
        outcome = run_bounded(main(), timeout=30)
    finally:
        worker.close()
    assert outcome == {"held": ["DispatchReply"] * 3, "late": ["OVERLOADED", "OVERLOADED"], "carol": ["DispatchReply"]}
