"""The OpenAI API's request and response shapes, without HTTP: validate a body into a :class:`Job`, render answers.

Pure functions and values (no aiohttp, no asyncio), so every refusal and every chunk
shape is tested without a server; :mod:`node.gateway.server` puts them on the wire and
:mod:`node.gateway.engine` runs the jobs.

* Defaults as OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions (chat:
  the rest of the context). Only n=1; logprobs, echo, suffix, penalties, logit_bias,
  tools and non-text response formats are refused with a 400 naming the parameter.
  Sampled requests without a ``seed`` get a fresh one.
* Session id: the ``X-Session-Id`` header, else the request's ``user`` field.
* Chat prompt template (the embedded model has none): one line per message,
  ``"System: ..."``, ``"User: ..."``, ``"Assistant: ..."``, then ``"Assistant:"``;
  generation also stops at ``"\\nUser:"``.
* API key (``--api-key``): clients send ``Authorization: Bearer KEY``, as the OpenAI client does; the key is
  compared in constant time (``hmac.compare_digest``), and a request without it or with another gets a 401 in
  OpenAI's shape (``code: "invalid_api_key"``). Every path but :data:`OPEN_PATHS` needs it.
* Errors are OpenAI-style JSON, ``{"error": {"message", "type", "param", "code"}}``. A body
  that is not JSON, nests deeper than ``MAX_JSON_DEPTH``, gives a field the wrong type or
  holds text that is not Unicode (a lone surrogate such as ``"\\ud800"``, which JSON allows)
  is a 400 naming what is wrong, never a 500.
* Request bodies: a ``Content-Encoding`` the server does not decode (or a stack of several) is a 415 naming the ones
  it does, checked before the body is read (aiohttp would hand an unknown coding's bytes over undecoded).
"""

from __future__ import annotations

import hmac
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from experts.errors import MoeSwarmError
from experts.generate import Sampling
from experts.tokenizer import Tokenizer

CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"
MAX_STOP = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_JSON_DEPTH = 32  # a chat request nests 5 deep; Python's parser would recurse (and fail) near 1000


class ApiError(MoeSwarmError):
    """A request the gateway refuses, with the HTTP status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# What a client learns of a 500: the exception text may hold paths, peer ids or prompts, so it stays in the log.
INTERNAL_ERROR = ApiError(500, "internal error: the server could not complete this request; its log has the details", type="server_error")


# Paths a supervisor probes without credentials (liveness and readiness say nothing about the swarm's contents);
# every other path of a gateway with an API key needs it: /v1/*, /status, /status.json and /metrics.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def check_api_key(authorization: str | None, key: str) -> None:
    """Accept ``Authorization: Bearer <key>`` (scheme case-insensitive), compared in constant time; 401 otherwise."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(401, "no API key given: send it in an Authorization header, 'Authorization: Bearer YOUR_KEY' (the OpenAI client does this with api_key=...)", code="invalid_api_key")
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), key.encode("utf-8")):
        raise ApiError(401, "incorrect API key: the gateway was started with another --api-key (or MOESWARM_API_KEY)", code="invalid_api_key")


# --- requests -------------------------------------------------------------------------------------


def parse_body(raw: bytes) -> object:
    """The request body's JSON value; 400 for bytes that are not UTF-8 JSON or nest too deep."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body nests too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests too deeply (at most {MAX_JSON_DEPTH} levels)")
    return body


def check_content_encoding(header: str | None, decoded: Sequence[str]) -> None:
    """Accept no ``Content-Encoding``, ``identity``, or one of *decoded* (case-insensitive); 415 otherwise (RFC 9110
    §15.5.16), since anything else would reach the JSON parser as compressed bytes."""
    codings = [c.strip().lower() for c in (header or "").split(",") if c.strip() and c.strip().lower() != "identity"]
    if not codings or (len(codings) == 1 and codings[0] in decoded):
        return
    raise ApiError(415, f"Content-Encoding {(header or '').strip()!r} is not supported: send the body as identity or one of {', '.join(decoded)}", param="Content-Encoding", code="unsupported_content_encoding")


def _depth(value: object) -> int:
    """How deeply arrays and objects nest in a decoded JSON value (iterative: no recursion limit to hit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((child, d + 1) for child in (v.values() if isinstance(v, dict) else v))
    return deepest


def _text(value: str, param: str) -> str:
    """*value*, if it is text that UTF-8 can encode (JSON's ``"\\ud800"`` decodes to a lone surrogate, which cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' is not valid Unicode text (it holds a lone surrogate such as \\ud800)", param=param) from None
    return value


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
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}] needs a 'role' among {sorted(CHAT_ROLES)}", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts", param=f"messages[{i}].content")
        lines.append(f"{CHAT_ROLES[m['role']]}: {_text(content, f'messages[{i}].content')}\n")
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
    stop = [_text(s, "stop") for s in stop]
    if chat and CHAT_STOP not in stop:
        stop.append(CHAT_STOP)
    return Job(tuple(prompt), max_tokens, sampling, tuple(stop), session)


def _prompt_tokens(prompt: object, tok: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tok.encode(_text(prompt, "prompt"))
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



def check_model(name: object, served: str) -> None:
    """Refuse (404) a request for any model but the one served."""
    if name != served:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {served!r}", param="model", code="model_not_found")


def parse_request(body: object, *, chat: bool, served: str, tok: Tokenizer, context_length: int, session_header: str | None) -> Job:
    """A decoded request body into a :class:`Job`: the model asked for, then the session and the parameters."""
    if isinstance(body, dict):
        check_model(body.get("model"), served)
    session = session_header or (body.get("user") if isinstance(body, dict) and isinstance(body.get("user"), str) else None)
    job = parse_job(body, chat=chat, tok=tok, context_length=context_length, session=session or None)
    assert isinstance(body, dict)  # parse_job refused anything else
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    if options is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed with stream=true", param="stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object such as {\"include_usage\": true}", param="stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options.include_usage' must be true or false", param="stream_options.include_usage")
    return job


# --- responses ------------------------------------------------------------------------------------


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "moeswarm"}


def sse(obj: dict | str) -> bytes:
    """One server-sent event carrying *obj* (JSON, or a literal such as ``[DONE]``)."""
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))).encode() + b"\n\n"


@dataclass(frozen=True)
class Reply:
    """One response's envelope (id, object, created, model, fingerprint) and the shapes of its bodies and chunks."""

    chat: bool
    head: dict
    include_usage: bool = False  # streamed: a last chunk carries the usage (and every chunk a null one)

    @classmethod
    def new(cls, body: dict, *, chat: bool, model: str, fingerprint: str) -> Reply:
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": fingerprint,
        }
        include_usage = bool(body.get("stream")) and bool((body.get("stream_options") or {}).get("include_usage"))
        return cls(chat, head, include_usage)

    @property
    def id(self) -> str:
        return self.head["id"]

    def body(self, text: str, done: Finished) -> dict:
        """The whole (non-streamed) response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": done.finish_reason}
            return {**self.head, "object": "chat.completion", "choices": [choice], "usage": done.usage()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        return {**self.head, "choices": [choice], "usage": done.usage()}

    def chunk(self, delta: str | None, finish: str | None = None, *, role: bool = False) -> dict:
        """A streamed chunk: a text delta, the finish reason, or (chat, *role*) the opening assistant role."""
        usage = {"usage": None} if self.include_usage else {}
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
            return {**self.head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}], **usage}
        return {**self.head, "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}], **usage}

    def usage_chunk(self, done: Finished) -> dict:
        return {**self.head, "choices": [], "usage": done.usage()}
