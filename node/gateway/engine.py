"""The gateway's engine: OpenAI jobs decoded as concurrent sequences, no HTTP.

Each job decodes on its own thread with its own KV cache, and the sequences' MoE layers
go out as one dispatch per layer through a :class:`node.backbone.batching.BatchingMoE`
(continuous batching): at most ``max_batch`` run, up to ``max_queue`` more wait for a
slot, and the rest are refused (:class:`QueueFull`).

* Greedy jobs (temperature 0) decode speculatively: the same tokens in fewer passes.
  Sampled jobs draw from ``generate``'s distribution with their seed: the same seed
  gives the same text, alone or batched.
* A repeated prompt prefix (a resent chat history) starts from cached keys/values
  (:mod:`node.backbone.prefix_cache`), handed to the generator as its starting cache and
  scoped to the session (jobs without one share an anonymous scope);
  :attr:`Finished.cached_tokens` says how many positions were reused.
* The session also pins the hosts its dispatches go to (slot affinity).
* A spot check that catches a worker rolls every sequence that used its unchecked sums
  back to the first such position and decodes it again (:func:`exact_generate`), so the
  text equals the honest run; text is sent only once no catch can retract it
  (:class:`HeldText`), streamed or not.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from experts.errors import MoeSwarmError
from experts.forward import Backbone, KVCache
from experts.generate import generate
from experts.speculative import pick_drafter, speculative_generate
from experts.tokenizer import StreamDecoder, Tokenizer
from node.backbone.batching import BatchingMoE
from node.backbone.dispatch import Pins, RemoteMoE
from node.backbone.prefix_cache import PrefixCache
from node.backbone.provenance import Provenance, Rollback, RollbackStats, exact_generate
from node.gateway.openai import Finished, Job, StopMatcher

log = structlog.get_logger("node.gateway.engine")

MAX_SESSIONS = 4096  # sessions whose host pins are remembered (LRU)


class QueueFull(MoeSwarmError):
    """Every slot is taken and the queue is full: the client should come back later (HTTP 429)."""


class Stream:
    """One request's output as it is produced: text deltas, then a :class:`Finished` (or an exception)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, item: str | Finished | BaseException) -> None:
        """From the sequence's thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def cancel(self) -> None:
        """The client went away: the sequence stops after its current token."""
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[str | Finished]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Finished):
                return


@dataclass
class EngineStats:
    requests: int = 0
    active: int = 0
    waiting: int = 0
    rejected: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def summary(self) -> dict:
        return dict(vars(self))


class Engine:
    """Runs jobs as concurrent sequences (at most *max_batch*; up to *max_queue* more wait) over one BatchingMoE."""

    def __init__(self, backbone: Backbone, tok: Tokenizer, moe: BatchingMoE, *, max_batch: int = 8, max_queue: int = 64, prefix_cache: PrefixCache | None = None, speculative: bool = True, drafter: str = "ngram") -> None:
        self.backbone, self.tok, self.moe = backbone, tok, moe
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.speculative = speculative
        self.drafter = pick_drafter(backbone, drafter)  # ngram: the model's table when one ships beside it; mtp: its MTP block
        self.stats = EngineStats()
        self.rollbacks = RollbackStats()  # what catches cost the sequences (all of them together)
        self._slots = asyncio.Semaphore(max_batch)
        self._pool = ThreadPoolExecutor(max_batch, thread_name_prefix="sequence")
        self._pins: OrderedDict[str, Pins] = OrderedDict()

    async def start(self, job: Job) -> Stream:
        """Wait for a free slot, then start decoding *job* on its own thread."""
        if self._slots.locked() and self.stats.waiting >= self.max_queue:
            self.stats.rejected += 1
            raise QueueFull(f"{self.stats.active} requests are running and {self.stats.waiting} waiting; try again later")
        self.stats.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.stats.waiting -= 1
        loop = asyncio.get_running_loop()
        stream = Stream(loop)
        self.stats.requests += 1
        self.stats.active += 1
        done = loop.run_in_executor(self._pool, self._run, job, stream, self._session_pins(job.session))
        done.add_done_callback(functools.partial(self._finished, stream))
        return stream

    def _session_pins(self, session: str | None) -> Pins | None:
        if session is None or not isinstance(self.moe.inner, RemoteMoE):
            return None
        pins = self._pins.setdefault(session, {})
        self._pins.move_to_end(session)
        while len(self._pins) > MAX_SESSIONS:
            self._pins.popitem(last=False)
        return pins

    def _finished(self, stream: Stream, done: asyncio.Future) -> None:
        """On the loop: count the job, then end its stream, so a client that has read the last item sees it counted
        (the thread's own ``put`` would reach the client before this callback runs)."""
        self._slots.release()
        self.stats.active -= 1
        result = None if done.cancelled() else done.result()  # cancelled: the pool shut down before it ran
        if isinstance(result, Finished):
            self.stats.prompt_tokens += result.prompt_tokens
            self.stats.completion_tokens += result.completion_tokens
            self.stats.cached_tokens += result.cached_tokens
        else:
            self.stats.failed += 1
        if result is not None:
            stream.put(result)

    def _run(self, job: Job, stream: Stream, pins: Pins | None) -> Finished | Exception:
        """On the sequence's thread: decode, stream text out, keep the KV for later prompts. The outcome ends the
        stream in ``_finished``."""
        try:
            return self._decode(job, stream, pins)
        except Exception as exc:  # the stream carries it to the client; the engine goes on
            log.warning("gateway.sequence_failed", error=repr(exc))
            return exc

    def _decode(self, job: Job, stream: Stream, pins: Pins | None) -> Finished:
        prompt = list(job.prompt)
        culprits: list[str] = self.moe.inner.checker.culprits if isinstance(self.moe.inner, RemoteMoE) else []
        settle = self.moe.inner.settle_blocking if isinstance(self.moe.inner, RemoteMoE) else None
        provenance = Provenance(culprits, settle)  # before the lookup (see Provenance.inherit)
        cache, taint = self.prefix_cache.lookup(job.session, prompt, culprits) if self.prefix_cache else (KVCache(), {})
        cached = cache.n_past  # read now: the generator extends the cache
        provenance.inherit(taint)
        text = HeldText(self.tok, job.stop)
        if job.sampling.temperature <= 0 and self.speculative:
            decode = functools.partial(speculative_generate, sampling=job.sampling, drafter=self.drafter)
        else:
            decode = functools.partial(generate, sampling=job.sampling)
        with self.moe.member(pins, provenance) as hook:
            steps = exact_generate(self.backbone, prompt, job.max_tokens, hook, provenance, decode=decode, stop={self.tok.eos_id}, stats=self.rollbacks, cache=cache, until=lambda _: text.finish is not None)
            try:
                for step in steps:
                    if isinstance(step, Rollback):
                        text.retract(step.keep)
                    else:
                        text.push(step[0])
                    for delta in text.release(provenance.final(len(prompt), len(text.tokens))):
                        stream.put(delta)
                    if stream.cancelled.is_set():
                        break
            finally:
                steps.close()
        for delta in text.release(len(text.tokens)) + [text.tail()]:  # decoding ended after its last check: all final
            if delta:
                stream.put(delta)
        if self.prefix_cache:
            self.prefix_cache.store(job.session, prompt + text.tokens, cache, provenance.taint(cache.n_past))
        return Finished(text.finish or "length", len(prompt), len(text.tokens), cached)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class HeldText:
    """A sequence's text, sent only as far as its tokens are final (no spot-check catch can retract them).

    A token drawn after a position that used an unchecked remote sum may be retracted by a
    catch (:mod:`node.backbone.provenance`), and a chunk already streamed cannot be unsent;
    so text is held until :meth:`release` says its tokens are final, or the sequence ended
    after its last check. :meth:`retract` replays the kept tokens through a fresh decoder and
    stop matcher: the text already released comes out of the replay unchanged (a rollback
    never cuts into final tokens), the rest is held again.
    """

    def __init__(self, tok: Tokenizer, stops: Sequence[str]) -> None:
        self._tok, self._stops = tok, stops
        self.tokens: list[int] = []
        self._sent = 0  # deltas released
        self._start()

    def _start(self) -> None:
        self._decoder, self._matcher = StreamDecoder(self._tok), StopMatcher(self._stops)
        self._deltas: list[tuple[int, str]] = []  # (tokens it comes from, text)
        self.finish: str | None = None  # "stop": EOS or a stop string ended the text

    def push(self, token: int) -> None:
        self.tokens.append(token)
        if self.finish is not None:
            return
        if token == self._tok.eos_id:
            self.finish = "stop"
            return
        delta, hit = self._matcher.push(self._decoder.push(token))
        if delta:
            self._deltas.append((len(self.tokens), delta))
        if hit:
            self.finish = "stop"

    def retract(self, keep: int) -> None:
        """Tokens after the first *keep* are gone (a rollback)."""
        kept, self.tokens = self.tokens[:keep], []
        self._start()
        for t in kept:
            self.push(t)

    def release(self, final: int) -> list[str]:
        """The held text that comes from the first *final* tokens, once."""
        n = self._sent
        while n < len(self._deltas) and self._deltas[n][0] <= final:
            n += 1
        out, self._sent = [d for _, d in self._deltas[self._sent : n]], n
        return out

    def tail(self) -> str:
        """What the decoder and the stop matcher still hold at the end (nothing after a stop)."""
        if self.finish is not None:
            return ""
        return self._matcher.push(self._decoder.flush())[0] + self._matcher.flush()

