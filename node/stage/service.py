"""The stage service: a QUIC endpoint handler that runs passes of hidden states through this node's layers.

Why a thread: a pass is a synchronous numpy forward over several layers (milliseconds to seconds) whose MoE hook
may itself wait on workers over this process's event loop (``RemoteMoE.hook`` from a thread), so it cannot run on
the loop. It runs on one thread of its own, so passes run one at a time: a :class:`StageRunner`'s session caches are
no thread-safe structure, and one pass at a time keeps every pass batch invariant (the bits of a local run). Passes
of other sessions queue meanwhile; batching several sessions into one pass is later work (issue 26, item 2).

Bad input is answered with an ErrorReply, never an exception (the worker service's habit): undecodable bytes
MALFORMED, another model UNKNOWN_MODEL, other layers NOT_HOSTED, states the runner cannot run (width, NaN, past the
context) MALFORMED, a pass past what the stage holds STAGE_GAP with ``held`` (the client replays), a failing compute
INTERNAL (its class name only).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import structlog

from experts.forward import MoeFfn
from experts.stage_forward import BadPass, StageGap, StageRunner
from node.worker.service import ComputeFailed, NotHosted, UnknownModel  # the worker's refusals, the same codes
from p2p.identity import PeerId
from p2p.lograte_edge import ThrottledLog
from p2p.wire import messages as wire

from .rows import rows_bytes, rows_of

log = structlog.get_logger("node.stage.service")


class Gap(wire.ProtocolError):
    """A StageGap as the wire answers it: STAGE_GAP, with ``held`` in its own field."""

    error_code = wire.ErrorCode.STAGE_GAP

    def __init__(self, gap: StageGap) -> None:
        super().__init__("start", str(gap))
        self.held = gap.held


class StageService:
    """Serves StagePass (and Ping) for *runner*'s layers; *moe_ffn* computes the MoE layers' experts (local or remote)."""

    def __init__(self, runner: StageRunner, moe_ffn: MoeFfn) -> None:
        self.runner, self.moe_ffn = runner, moe_ffn
        self.model_id = wire.model_id_of(bytes.fromhex(runner.model.digest))
        self.layers = (runner.layers.start, runner.layers.stop)
        self.passes = self.rows = self.errors = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._peer_log = ThrottledLog(log)  # anyone may send bad passes: a few lines, then a count

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def handle(self, peer: PeerId, data: bytes) -> bytes:
        """One request message in, one reply message out."""
        session = wire.ZERO_ID
        try:
            msg = wire.decode(data)
            if isinstance(msg, wire.Ping):
                return wire.Pong.answering(msg).encode()
            if not isinstance(msg, wire.StagePass):
                raise wire.InvalidField("type", f"a stage answers StagePass and Ping, not {type(msg).__name__}")
            session = msg.session
            return (await self._pass(peer, msg)).encode()
        except wire.ProtocolError as exc:
            self.errors += 1
            event = "stage.gap" if isinstance(exc, Gap) else "stage.refused"
            self._peer_log.warning(event, peer=str(peer), error=str(exc), bytes_in=len(data))
            return wire.error_reply_for(exc, session).encode()

    async def _pass(self, peer: PeerId, msg: wire.StagePass) -> wire.StageReply:
        if msg.model_id != self.model_id:
            raise UnknownModel("model_id", f"this stage serves model {self.runner.model.digest[:16]}..., not {msg.model_id.hex()[:16]}...")
        if msg.layers != self.layers:
            raise NotHosted("layers", f"this stage runs layers {self.layers[0]}-{self.layers[1] - 1}, not {msg.layers[0]}-{msg.layers[1] - 1}")
        t0 = time.perf_counter()
        x = rows_of(msg)
        loop = asyncio.get_running_loop()
        try:
            y = await loop.run_in_executor(self._pool, self.runner.pass_hidden, msg.session.hex(), x, msg.start, self.moe_ffn)
        except StageGap as gap:
            raise Gap(gap) from None
        except BadPass as exc:
            raise wire.InvalidField("rows", str(exc)) from None
        except Exception as exc:  # a compute failure fails this pass, not the stage
            log.error("stage.compute_failed", peer=str(peer), error=repr(exc))
            raise ComputeFailed("compute", f"{type(exc).__name__}") from None
        compute_us = int((time.perf_counter() - t0) * 1e6)
        self.passes += 1
        self.rows += msg.n_rows
        log.debug("stage.pass_served", peer=str(peer), session=msg.session.hex(), start=msg.start, rows=msg.n_rows, compute_us=compute_us)
        return wire.StageReply(msg.session, msg.n_rows, msg.width, rows_bytes(y), min(compute_us, 0xFFFFFFFF))
