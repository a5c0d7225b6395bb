"""Malformed requests get a 400 in OpenAI's error shape, never a 500: over HTTP, and in the pure parser."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.tokenizer import Tokenizer
from node.gateway.openai import MAX_JSON_DEPTH, ApiError, check_api_key, parse_body, parse_request
from node.gateway.server import Gateway

MODEL = GGUFModel(EMBEDDED_MODEL)
TOK = Tokenizer.from_spec(MODEL.tokenizer_spec)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


BAD_BODIES: list[tuple[str, bytes, str | None, str]] = [
    # (path, raw body, the param the error names, a piece of its message)
    ("/v1/completions", nested(100_000), None, "nests too deeply"),  # RecursionError in the JSON parser
    ("/v1/completions", json.dumps({"model": "embedded", "prompt": "a", "x": json.loads(nested(MAX_JSON_DEPTH))}).encode(), None, "nests too deeply"),
    ("/v1/completions", b'{"model": "embedded", "prompt": "a", "stream": true, "stream_options": "yes"}', "stream_options", "must be an object"),
    ("/v1/completions", b'{"model": "embedded", "prompt": "a", "stream": true, "stream_options": [1]}', "stream_options", "must be an object"),
    ("/v1/completions", b'{"model": "embedded", "prompt": "a", "stream": true, "stream_options": {"include_usage": "no"}}', "stream_options.include_usage", "true or false"),
    ("/v1/completions", b'{"model": "embedded", "prompt": "a", "stream": "yes"}', "stream", "true or false"),
    ("/v1/completions", b'{"model": "embedded", "prompt": "And \\ud800 God"}', "prompt", "lone surrogate"),
    ("/v1/completions", b'{"model": "embedded", "prompt": ["\\udfff"]}', "prompt", "lone surrogate"),
    ("/v1/completions", b'{"model": "embedded", "prompt": "a", "stop": ["\\ud83d"]}', "stop", "lone surrogate"),
    ("/v1/chat/completions", b'{"model": "embedded", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", "lone surrogate"),
    ("/v1/chat/completions", b'{"model": "embedded", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages[0].content", "lone surrogate"),
    ("/v1/chat/completions", b'{"model": "embedded", "messages": [{"role": ["user"], "content": "hi"}]}', "messages[0].role", "needs a 'role'"),
    ("/v1/completions", b'\xff\xfe{"model": 1}', None, "not valid JSON"),
]


def post_all(cases: list[tuple[str, bytes, str | None, str]]) -> list[tuple[int, dict]]:
    """POST each raw body to a gateway whose engine is never reached (validation comes first)."""
    engine = SimpleNamespace(tok=TOK, backbone=SimpleNamespace(cfg=MODEL.cfg))
    gateway = Gateway(engine, "embedded", MODEL.digest)  # type: ignore[arg-type]

    async def scenario() -> list[tuple[int, dict]]:
        async with TestClient(TestServer(gateway.app)) as client:
            out = []
            for path, raw, _, _ in cases:
                resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(scenario())


def test_malformed_bodies_get_400_naming_the_problem():
    """Deep nesting, wrong-typed stream options, lone surrogates in any text field, an unhashable role and
    non-UTF-8 bytes: each answers 400 with an OpenAI error object that names the parameter."""
    for (_, raw, param, message), (status, body) in zip(BAD_BODIES, post_all(BAD_BODIES), strict=True):
        case = raw[:80]
        assert status == 400, (case, body)
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == "invalid_request_error", (case, body)
        assert body["error"]["param"] == param and message in body["error"]["message"], (case, body)


def test_depth_limit_is_exact_and_does_not_recurse():
    """MAX_JSON_DEPTH levels parse, one more is refused; a body far past Python's recursion limit is a 400 too."""
    assert parse_body(nested(MAX_JSON_DEPTH)) == json.loads(nested(MAX_JSON_DEPTH))
    for raw in (nested(MAX_JSON_DEPTH + 1), nested(50_000), b'{"a":' * 5000 + b"1" + b"}" * 5000):
        with pytest.raises(ApiError) as err:
            parse_body(raw)
        assert err.value.status == 400 and "nests too deeply" in err.value.message


def test_well_formed_text_and_stream_options_still_parse():
    """Astral characters (a proper surrogate pair in JSON) are fine; include_usage as a bool is accepted."""
    body = parse_body(b'{"model": "embedded", "prompt": "And \\ud83d\\ude00", "stream": true, "stream_options": {"include_usage": true}}')
    job = parse_request(body, chat=False, served="embedded", tok=TOK, context_length=MODEL.cfg.context_length, session_header=None)
    assert job.prompt == tuple(TOK.encode("And \U0001f600"))


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer  ", "Basic sk-1", "sk-1", "Bearer sk-2", "Bearer sk-1x", "Bearer \udcff"])
def test_a_missing_or_other_api_key_is_a_401(header):
    """Anything but ``Bearer <the key>`` is OpenAI's 401 ``invalid_api_key`` (also a header that is not UTF-8)."""
    with pytest.raises(ApiError) as caught:
        check_api_key(header, "sk-1")
    assert caught.value.status == 401 and caught.value.body()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("header", ["Bearer sk-1", "bearer sk-1", "BEARER  sk-1 "])
def test_the_bearer_key_is_accepted_whatever_the_scheme_case(header):
    """The scheme is case-insensitive (RFC 7235) and surrounding blanks do not matter."""
    check_api_key(header, "sk-1")
