"""OpenAI-compatible HTTP gateway for a backbone: /v1/models, /v1/completions, /v1/chat/completions.

Requests become concurrent sequences (:class:`Engine`): each decodes on its own thread
with its own KV cache, and their MoE layers go out as one dispatch per layer through a
:class:`node.batching.BatchingMoE` (continuous batching). The HTTP server (aiohttp) runs
on the same asyncio loop as the QUIC endpoint, so dispatch and HTTP share one thread
and no locks.

* Greedy requests (temperature 0) decode speculatively (prompt lookup): the same tokens
  in fewer passes. Sampled requests draw from ``generate``'s distribution with their
  ``seed`` (a fresh one when none is given): the same seed gives the same text, alone
  or batched.
* Defaults as OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions (chat:
  the rest of the context). Only n=1; logprobs, echo, suffix, penalties, logit_bias,
  tools and non-text response formats are refused with a 400 naming the parameter.
* A repeated prompt prefix (a resent chat history) starts from cached keys/values
  (:mod:`node.backbone.prefix_cache`), scoped to the session (requests without one share an
  anonymous scope); ``usage.prompt_tokens_details.cached_tokens`` says how many
  positions were reused, ``GET /v1/stats`` adds up hits, batching and dispatches.
* Session id: the ``X-Session-Id`` header, else the request's ``user`` field. It scopes
  the prefix cache and pins the hosts a session's dispatches go to (slot affinity).
* Chat prompt template (the embedded model has none): one line per message,
  ``"System: ..."``, ``"User: ..."``, ``"Assistant: ..."``, then ``"Assistant:"``;
  generation also stops at ``"\\nUser:"``.
* Errors are OpenAI-style JSON, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
from aiohttp import web

from experts.errors import MoeSwarmError
from experts.forward import Backbone
from experts.generate import Sampling, generate
from experts.speculative import default_drafter, speculative_generate
from experts.tokenizer import StreamDecoder, Tokenizer

from node.backbone.dispatch import Pins, RemoteMoE
from node.backbone.batching import BatchingMoE
from node.backbone.prefix_cache import PrefixCache, ResumedBackbone

log = structlog.get_logger("node.gateway.server")

CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"
MAX_STOP = 4
MAX_SESSIONS = 4096  # sessions whose host pins are remembered (LRU)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(MoeSwarmError):
    """A request the gateway refuses, with the HTTP status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# What a client learns of a 500: the exception text may hold paths, peer ids or prompts, so it stays in the log.
INTERNAL_ERROR = ApiError(500, "internal error: the server could not complete this request; its log has the details", type="server_error")


# --- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    session: str | None = None


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (end of text or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def render_chat(messages: object) -> str:
    """The prompt for a chat: one ``Role: content`` line per message, then ``Assistant:``."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}] needs a 'role' among {sorted(CHAT_ROLES)}", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts", param=f"messages[{i}].content")
        lines.append(f"{CHAT_ROLES[m['role']]}: {content}\n")
    return "".join(lines) + "Assistant:"


def _num(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise ApiError(400, f"'{name}' must be a number in {'(' if lo_open else '['}{lo}, {hi}]", param=name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ApiError(400, f"'{name}' must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""), param=name)
    return v


def _refuse_unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "only best_of=1 is supported", param="best_of")
    unsupported = {
        "logprobs": bool(body.get("logprobs")),
        "top_logprobs": body.get("top_logprobs") is not None,
        "echo": bool(body.get("echo")),
        "suffix": bool(body.get("suffix")),
        "logit_bias": bool(body.get("logit_bias")),
        "presence_penalty": body.get("presence_penalty") not in (None, 0),
        "frequency_penalty": body.get("frequency_penalty") not in (None, 0),
        "tools": bool(body.get("tools")) or bool(body.get("functions")),
        "response_format": body.get("response_format") not in (None, {"type": "text"}),
    }
    for name, used in unsupported.items():
        if used:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)


def parse_job(body: object, *, chat: bool, tok: Tokenizer, context_length: int, session: str | None) -> Job:
    """Validate an OpenAI request body into a :class:`Job` (raises :class:`ApiError`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    if chat:
        prompt = tok.encode(render_chat(body.get("messages")))
    else:
        prompt = _prompt_tokens(body.get("prompt"), tok)
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    room = context_length - len(prompt)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; the model's context is {context_length}", param="messages" if chat else "prompt", code="context_length_exceeded")
    max_tokens = _int(body, "max_completion_tokens", 1) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise ApiError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {context_length}", param="max_tokens", code="context_length_exceeded")
    seed = _int(body, "seed", 0, 2**63 - 1)
    sampling = Sampling(
        temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1,
    )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or an array of at most {MAX_STOP} of them", param="stop")
    if chat and CHAT_STOP not in stop:
        stop.append(CHAT_STOP)
    return Job(tuple(prompt), max_tokens, sampling, tuple(stop), session)


def _prompt_tokens(prompt: object, tok: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tok.vocab_size for t in prompt):
            raise ApiError(400, f"token ids must be in 0..{tok.vocab_size - 1}", param="prompt")
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)", param="prompt")


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that might be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is safe to emit now, whether a stop string was reached: then nothing after it is emitted)."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


# --- sequences ------------------------------------------------------------------------------------


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

    def __init__(self, backbone: Backbone, tok: Tokenizer, moe: BatchingMoE, *, max_batch: int = 8, max_queue: int = 64, prefix_cache: PrefixCache | None = None, speculative: bool = True) -> None:
        self.backbone, self.tok, self.moe = backbone, tok, moe
        self.max_queue = max_queue
        self.prefix_cache = prefix_cache
        self.speculative = speculative
        self.drafter = default_drafter(backbone.model)  # the model's n-gram table when one ships beside it
        self.stats = EngineStats()
        self._slots = asyncio.Semaphore(max_batch)
        self._pool = ThreadPoolExecutor(max_batch, thread_name_prefix="sequence")
        self._pins: OrderedDict[str, Pins] = OrderedDict()

    async def start(self, job: Job) -> Stream:
        """Wait for a free slot, then start decoding *job* on its own thread."""
        if self._slots.locked() and self.stats.waiting >= self.max_queue:
            self.stats.rejected += 1
            raise ApiError(429, f"{self.stats.active} requests are running and {self.stats.waiting} waiting; try again later", code="rate_limit_exceeded", type="rate_limit_error")
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
        done.add_done_callback(self._finished)
        return stream

    def _session_pins(self, session: str | None) -> Pins | None:
        if session is None or not isinstance(self.moe.inner, RemoteMoE):
            return None
        pins = self._pins.setdefault(session, {})
        self._pins.move_to_end(session)
        while len(self._pins) > MAX_SESSIONS:
            self._pins.popitem(last=False)
        return pins

    def _finished(self, done: asyncio.Future) -> None:
        self._slots.release()
        self.stats.active -= 1
        result = None if done.cancelled() else done.result()  # cancelled: the pool shut down before it ran
        if isinstance(result, Finished):
            self.stats.prompt_tokens += result.prompt_tokens
            self.stats.completion_tokens += result.completion_tokens
            self.stats.cached_tokens += result.cached_tokens
        else:
            self.stats.failed += 1

    def _run(self, job: Job, stream: Stream, pins: Pins | None) -> Finished | Exception:
        """On the sequence's thread: decode, stream text out, keep the KV for later prompts."""
        try:
            result = self._decode(job, stream, pins)
        except Exception as exc:  # reported to the client as a 500; the server goes on
            log.warning("gateway.sequence_failed", error=repr(exc))
            stream.put(exc)
            return exc
        stream.put(result)
        return result

    def _decode(self, job: Job, stream: Stream, pins: Pins | None) -> Finished:
        prompt = list(job.prompt)
        prefix = self.prefix_cache.lookup(job.session, prompt) if self.prefix_cache else None
        bb = ResumedBackbone(self.backbone, prefix) if prefix is not None else self.backbone
        eos = self.tok.eos_id
        stops, text = StopMatcher(job.stop), StreamDecoder(self.tok)
        out: list[int] = []
        finish, hit_stop = "length", False
        with self.moe.member(pins) as hook:
            if job.sampling.temperature <= 0 and self.speculative:
                steps = speculative_generate(bb, prompt, job.max_tokens, hook, sampling=job.sampling, stop={eos}, drafter=self.drafter)
            else:
                steps = generate(bb, prompt, job.max_tokens, hook, sampling=job.sampling, stop={eos})
            try:
                for t, _ in steps:
                    out.append(t)
                    if t == eos:
                        finish = "stop"
                        break
                    delta, hit_stop = stops.push(text.push(t))
                    if delta:
                        stream.put(delta)
                    if hit_stop:
                        finish = "stop"
                        break
                    if stream.cancelled.is_set():
                        break
            finally:
                steps.close()
        if not hit_stop and (tail := stops.push(text.flush())[0] + stops.flush()):
            stream.put(tail)
        if self.prefix_cache and isinstance(bb, ResumedBackbone) and bb.cache is not None:
            self.prefix_cache.store(job.session, prompt + out, bb.cache)
        return Finished(finish, len(prompt), len(out), prefix.n_past if prefix is not None else 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# --- HTTP -----------------------------------------------------------------------------------------


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))).encode() + b"\n\n"


class Gateway:
    """The aiohttp application around an :class:`Engine`."""

    def __init__(self, engine: Engine, model_name: str, model_digest: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.fingerprint = "fp_" + model_digest[:12]
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._errors])
        self.app.add_routes([
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/stats", self.stats),
        ])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Serve on host:port (0: any free port) on the running loop; returns the bound address."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, shutdown_timeout=2.0).start()
        return host, sock.getsockname()[1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:  # unknown path, wrong method, body too large
            err = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code=exc.reason.lower().replace(" ", "_"))
            return web.json_response(err.body(), status=exc.status)
        except Exception as exc:  # a bug or a failed dispatch: the traceback goes to our log, not to the client
            log.error("gateway.request_failed", path=request.path, exc_info=exc)
            return web.json_response(INTERNAL_ERROR.body(), status=500)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moeswarm"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        body = {"requests": e.stats.summary(), "batching": e.moe.stats.summary()}
        if e.prefix_cache:
            body["prefix_cache"] = e.prefix_cache.summary()
        if isinstance(e.moe.inner, RemoteMoE):
            body["dispatch"] = e.moe.inner.stats.summary()
        return web.json_response(body)

    def _check_model(self, name: object) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}", param="model", code="model_not_found")

    async def _job(self, request: web.Request, chat: bool) -> tuple[dict, Job]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        if isinstance(body, dict):
            self._check_model(body.get("model"))
        session = request.headers.get("X-Session-Id") or (body.get("user") if isinstance(body, dict) and isinstance(body.get("user"), str) else None)
        job = parse_job(body, chat=chat, tok=self.engine.tok, context_length=self.engine.backbone.cfg.context_length, session=session or None)
        if body.get("stream_options") is not None and not body.get("stream"):
            raise ApiError(400, "'stream_options' is only allowed with stream=true", param="stream_options")
        return body, job

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, job = await self._job(request, chat=False)
        return await self._respond(request, body, job, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, job = await self._job(request, chat=True)
        return await self._respond(request, body, job, chat=True)

    async def _respond(self, request: web.Request, body: dict, job: Job, *, chat: bool) -> web.StreamResponse:
        stream = await self.engine.start(job)
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": self.fingerprint,
        }
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, stream, head, chat, include_usage)
            parts, done = [], None
            async for item in stream:
                if isinstance(item, Finished):
                    done = item
                else:
                    parts.append(item)
            text = "".join(parts)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": done.finish_reason}
                return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": done.usage()})
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
            return web.json_response({**head, "choices": [choice], "usage": done.usage()})
        finally:
            stream.cancel()

    async def _stream(self, request: web.Request, stream: Stream, head: dict, chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage = {"usage": None} if include_usage else {}

        def chunk(delta: str | None, finish: str | None = None, *, role: bool = False) -> dict:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
                return {**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}], **usage}
            return {**head, "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}], **usage}

        try:
            if chat:
                await resp.write(_sse(chunk(None, role=True)))
            try:
                async for item in stream:
                    if isinstance(item, Finished):
                        await resp.write(_sse(chunk(None, item.finish_reason)))
                        if include_usage:
                            await resp.write(_sse({**head, "choices": [], "usage": item.usage()}))
                    else:
                        await resp.write(_sse(chunk(item)))
            except ConnectionResetError:
                raise
            except Exception as exc:  # the status line is gone: report in the stream, as OpenAI does
                log.error("gateway.stream_failed", id=head["id"], exc_info=exc)
                await resp.write(_sse(INTERNAL_ERROR.body()))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
        except ConnectionResetError:  # the client left; the caller cancels the sequence
            log.info("gateway.client_left", id=head["id"])
        return resp
