"""OpenAI-compatible HTTP gateway for a backbone: /v1/models, /v1/completions, /v1/chat/completions.

The thin aiohttp edge: routes, JSON in, JSON or server-sent events out, errors to HTTP
statuses. Requests are validated and answers shaped by :mod:`node.gateway.openai`; the
jobs run in the :class:`node.gateway.engine.Engine` (continuous batching, prefix cache,
speculative decoding). The server runs on the same asyncio loop as the QUIC endpoint,
so dispatch and HTTP share one thread and no locks. ``GET /v1/stats`` adds up requests,
prefix-cache hits, batching and dispatches.

A client that disconnects cancels its request's handler (aiohttp's ``handler_cancellation``):
the handler's ``finally`` cancels the sequence, which stops after its current token, for a
streamed response and for a plain one alike (a plain one never writes before it is done,
so only the cancellation can tell it the client left).

The gateway binds its port before the swarm is found: until :meth:`Gateway.attach` hands it the engine, every
``/v1`` request gets 503 with the reason, and ``/healthz``, ``/readyz``, ``/metrics`` and ``/status``
(:mod:`node.status.server`) answer from the start, so a supervisor tells "starting" from "dead".

A request body that cannot be read is the client's fault, never a 500: a ``Content-Encoding`` aiohttp does not decode
gets 415 before the body is read; bytes that do not decode (bad gzip/deflate), chunked framing that breaks off, get
400; a body that has not fully arrived within ``body_timeout`` (a Content-Length larger than what is sent, a chunked
body without its last chunk, a slow-loris client) gets 408, and the connection is closed since its rest is unread.
Each writes one ``gateway.bad_body`` line, rate-limited (:mod:`p2p.lograte_edge`), since anyone can send them.
Framing aiohttp's parser refuses itself (a bad Content-Length, both it and chunked, a bad chunk size, br or zstd
without their decoder installed) it answers 400 in plain text, before any handler, logging only at debug.

With an API key every path but ``/healthz`` and ``/readyz`` needs ``Authorization: Bearer KEY``
(:func:`node.gateway.openai.check_api_key`); a 401 also carries ``WWW-Authenticate: Bearer`` (RFC 6750).
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD

from node.backbone.dispatch import RemoteMoE
from node.gateway.engine import Engine, QueueFull, Stream
from node.gateway.openai import INTERNAL_ERROR, OPEN_PATHS, ApiError, Finished, Reply, check_api_key, check_content_encoding, check_model, model_card, parse_body, parse_request, sse
from node.status.server import NodeStatus, add_routes, start_app
from p2p.lograte_edge import ThrottledLog

log = structlog.get_logger("node.gateway.server")
BODY_TIMEOUT = 30.0  # seconds for a request body to arrive in full once its headers have
DECODED = ("gzip", "deflate", *(("br",) if HAS_BROTLI else ()), *(("zstd",) if HAS_ZSTD else ()))  # aiohttp's decoders here


class Gateway:
    """The aiohttp application around an :class:`Engine` (given now, or later with :meth:`attach`)."""

    def __init__(self, engine: Engine | None, model_name: str, model_digest: str, status: NodeStatus | None = None, *, api_key: str | None = None, body_timeout: float = BODY_TIMEOUT) -> None:
        self._engine = engine
        self._api_key = api_key
        self.body_timeout = body_timeout
        self._bad_body_log = ThrottledLog(log)
        self.status = status
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
        if status is not None:
            add_routes(self.app, status)
        self._runner: web.AppRunner | None = None

    @property
    def engine(self) -> Engine:
        """The engine; before :meth:`attach`, a 503 saying why there is none yet."""
        if self._engine is None:
            reason = self.status.not_ready() if self.status else None
            raise ApiError(503, f"the gateway is not ready yet: {reason or 'starting'}", code="not_ready", type="server_error")
        return self._engine

    def attach(self, engine: Engine) -> None:
        self._engine = engine

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Serve on host:port (0: any free port) on the running loop; returns the bound address."""
        self._runner, addr = await start_app(self.app, host, port, handler_cancellation=True)
        return addr

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if self._api_key is not None and request.path not in OPEN_PATHS:
                check_api_key(request.headers.get("Authorization"), self._api_key)
            return await handler(request)
        except ApiError as exc:
            headers = {"WWW-Authenticate": 'Bearer realm="moeswarm"'} if exc.status == 401 else None
            resp = web.json_response(exc.body(), status=exc.status, headers=headers)
            if request.body_exists and not request.content.is_eof():  # the rest of the body is unread: its next
                resp.force_close()  # bytes are no request, so say Connection: close (aiohttp drains it, then closes)
            return resp
        except web.HTTPException as exc:  # unknown path, wrong method, body too large
            err = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code=exc.reason.lower().replace(" ", "_"))
            return web.json_response(err.body(), status=exc.status)
        except Exception as exc:  # a bug or a failed dispatch: the traceback goes to our log, not to the client
            log.error("gateway.request_failed", path=request.path, exc_info=exc)
            return web.json_response(INTERNAL_ERROR.body(), status=500)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card(self.model_name, self.created)]})

    async def model(self, request: web.Request) -> web.Response:
        check_model(request.match_info["model"], self.model_name)
        return web.json_response(model_card(self.model_name, self.created))

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        body = {"requests": e.stats.summary(), "batching": e.moe.stats.summary()}
        if e.prefix_cache:
            body["prefix_cache"] = e.prefix_cache.summary()
        if isinstance(e.moe.inner, RemoteMoE):
            body["dispatch"] = e.moe.inner.stats.summary()
            body["verification"] = {**e.moe.inner.checker.summary(), **e.rollbacks.summary()}
        return web.json_response(body)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._respond(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._respond(request, chat=True)

    async def _read_body(self, request: web.Request) -> bytes:
        """The decoded body, or the 4xx saying why it cannot be had (see the module docstring)."""
        try:
            check_content_encoding(request.headers.get("Content-Encoding"), DECODED)
            try:
                async with asyncio.timeout(self.body_timeout):
                    return await request.read()
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive in full within {self.body_timeout:g} s (a Content-Length larger than the body sent, or a chunked body without its last chunk)", code="request_timeout") from None
            except web.RequestPayloadError as exc:  # bad gzip/deflate bytes, broken chunked framing
                cause = exc.__cause__ or exc
                reason = " ".join(str(getattr(cause, "message", cause)).split())
                raise ApiError(400, f"the request body could not be read: {reason}", code="bad_request_body") from None
        except ApiError as exc:
            self._bad_body_log.info("gateway.bad_body", path=request.path, remote=request.remote, status=exc.status, reason=exc.message)
            raise

    async def _respond(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = parse_body(await self._read_body(request))
        tok, context_length = self.engine.tok, self.engine.backbone.cfg.context_length
        job = parse_request(body, chat=chat, served=self.model_name, tok=tok, context_length=context_length, session_header=request.headers.get("X-Session-Id"))
        assert isinstance(body, dict)  # parse_request refused any other JSON value (400)
        try:
            stream = await self.engine.start(job)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="rate_limit_exceeded", type="rate_limit_error") from None
        try:
            reply = Reply.new(body, chat=chat, model=self.model_name, fingerprint=self.fingerprint)
            if body.get("stream"):
                return await self._stream(request, stream, reply)
            parts, done = [], None
            async for item in stream:
                if isinstance(item, Finished):
                    done = item
                else:
                    parts.append(item)
            assert done is not None  # a stream ends with its Finished (or raises)
            return web.json_response(reply.body("".join(parts), done))
        except asyncio.CancelledError:  # the client disconnected (see the module docstring)
            log.debug("gateway.client_left", path=request.path)
            raise
        finally:
            stream.cancel()

    async def _stream(self, request: web.Request, stream: Stream, reply: Reply) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            if reply.chat:
                await resp.write(sse(reply.chunk(None, role=True)))
            try:
                async for item in stream:
                    if isinstance(item, Finished):
                        await resp.write(sse(reply.chunk(None, item.finish_reason)))
                        if reply.include_usage:
                            await resp.write(sse(reply.usage_chunk(item)))
                    else:
                        await resp.write(sse(reply.chunk(item)))
            except ConnectionResetError:
                raise
            except Exception as exc:  # the status line is gone: report in the stream, as OpenAI does
                log.error("gateway.stream_failed", id=reply.head["id"], exc_info=exc)
                await resp.write(sse(INTERNAL_ERROR.body()))
            await resp.write(sse("[DONE]"))
            await resp.write_eof()
        except ConnectionResetError:  # the client left; the caller cancels the sequence
            log.debug("gateway.client_left", id=reply.id)
        return resp
