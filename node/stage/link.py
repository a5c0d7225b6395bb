"""The client's link to a remote stage: :class:`experts.stage_forward.StageLink` over a QUIC endpoint.

``run`` is synchronous, as a :class:`StagedBackbone`'s forward is: it is called from a thread (the client runs its
forward off the event loop) and waits for the round trip on the endpoint's loop. What the chain needs from the
answer is typed: a STAGE_GAP error reply becomes :class:`StageGap` with the stage's ``held`` (the chain replays
from there), and everything that says "this stage will not answer this pass" -- no connection, a timeout, a
refusal, a reply of the wrong shape -- becomes :class:`StageLost` (the chain asks for a replacement and replays).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from experts.errors import LocalProtocolError
from experts.stage_forward import StageGap, StageLost
from p2p.identity import PeerId
from p2p.quic.endpoint import Endpoint
from p2p.quic.errors import TransportError
from p2p.wire import messages as wire

from .rows import rows_bytes, rows_of, session_id


@dataclass(frozen=True)
class RemoteStage:
    """Layers *layers* of the model *model_digest*, run by the stage *peer* at *addr*, reached over *endpoint*."""

    endpoint: Endpoint
    loop: asyncio.AbstractEventLoop
    addr: tuple[str, int]
    peer: PeerId
    model_digest: str
    layers: range
    timeout: float = 30.0

    def run(self, session: str, x: np.ndarray, start: int) -> np.ndarray:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise LocalProtocolError("RemoteStage.run waits on the event loop: call it from a thread, not from the loop")
        request = wire.StagePass(session_id(session), wire.model_id_of(bytes.fromhex(self.model_digest)), (self.layers.start, self.layers.stop), start, x.shape[0], x.shape[1], rows_bytes(x))
        call = asyncio.run_coroutine_threadsafe(self._call(request), self.loop)
        return self._answer(session, request, call.result())

    async def _call(self, request: wire.StagePass) -> bytes:
        try:
            return await self.endpoint.request(self.addr, self.peer, request.encode(), timeout=self.timeout)
        except TransportError as exc:
            raise StageLost(f"stage {self.peer} at {self.addr[0]}:{self.addr[1]} did not answer: {exc}") from exc

    def _answer(self, session: str, request: wire.StagePass, data: bytes) -> np.ndarray:
        where = f"stage {self.peer} (layers {self.layers.start}-{self.layers.stop - 1})"
        try:
            reply = wire.decode(data)
        except wire.ProtocolError as exc:
            raise StageLost(f"{where} sent a malformed reply: {exc}") from None
        if isinstance(reply, wire.ErrorReply):
            if reply.code is wire.ErrorCode.STAGE_GAP:
                raise StageGap(session, request.start, reply.held)
            raise StageLost(f"{where} refused the pass ({reply.code.name}): {reply.message}")
        if not isinstance(reply, wire.StageReply) or (reply.session, reply.n_rows, reply.width) != (request.session, request.n_rows, request.width):
            raise StageLost(f"{where} answered a pass of {request.n_rows} rows with {reply!r:.120}")
        return rows_of(reply)
