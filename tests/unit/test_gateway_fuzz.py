"""Gateway fuzz: generated request bodies never cause anything but a parsed job or a 4xx naming the problem.

Bodies mix the real OpenAI field names with values of every JSON type (and non-JSON bytes), so most are
malformed in some field; the pure parser sees >= 1,000 of them per endpoint, and every one it refuses is also
POSTed to a real aiohttp gateway, which must answer that same 4xx (never a 5xx)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.tokenizer import Tokenizer
from node.gateway.openai import ApiError, parse_body, parse_request
from node.gateway.server import Gateway

MODEL = GGUFModel(EMBEDDED_MODEL)
TOK = Tokenizer.from_spec(MODEL.tokenizer_spec)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stream", "stream_options", "stop", "seed", "n", "user",
          "logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "suffix", "best_of"]  # fmt: skip
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12) | st.sampled_from(["embedded", "user", "\ud800", ""])
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELDS), inner, max_size=4), max_leaves=12)
messages = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "name", "type", "text"]), values | st.sampled_from(["user", "system", "assistant", "tool"]), max_size=3),
    max_size=3,
)
model = st.integers(0, 9).flatmap(lambda i: st.just("embedded") if i else values)  # mostly right: the other fields get checked
objects = st.fixed_dictionaries({"model": model}, optional={f: values for f in FIELDS if f not in ("model", "prompt")} | {"messages": messages, "prompt": st.text(max_size=20) | values})
bodies = st.one_of(objects.map(lambda d: json.dumps(d).encode()), values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40))
REFUSED: dict[str, list[tuple[bytes, int, str]]] = {"/v1/completions": [], "/v1/chat/completions": []}


def outcome(raw: bytes, chat: bool) -> ApiError | None:
    """The pure parser's answer: None for a job, the ApiError for a refusal; anything else is raised (a defect)."""
    try:
        parse_request(parse_body(raw), chat=chat, served="embedded", tok=TOK, context_length=MODEL.cfg.context_length, session_header=None)
    except ApiError as exc:
        return exc
    return None


@settings(max_examples=1200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=bodies, chat=st.booleans())
def test_the_parser_answers_every_body_with_a_job_or_a_4xx(raw, chat):
    """No generated body makes the parser raise anything but a 4xx ApiError."""
    err = outcome(raw, chat)
    if err is not None:
        assert 400 <= err.status < 500, (raw[:200], err.status, err.message)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if len(REFUSED[path]) < 600:
            REFUSED[path].append((raw, err.status, err.message))


def test_the_http_gateway_answers_every_refused_body_with_the_same_4xx():
    """The bodies the parser refused, POSTed to a real gateway (whose engine is never reached): the same 4xx, in
    OpenAI's error shape, never a 5xx."""
    if not any(REFUSED.values()):  # run alone: generate the refused bodies here
        test_the_parser_answers_every_body_with_a_job_or_a_4xx()
    engine = SimpleNamespace(tok=TOK, backbone=SimpleNamespace(cfg=MODEL.cfg))
    gateway = Gateway(engine, "embedded", MODEL.digest)  # type: ignore[arg-type]

    async def scenario() -> int:
        sent = 0
        async with TestClient(TestServer(gateway.app)) as client:
            for path, cases in REFUSED.items():
                for raw, status, message in cases:
                    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
                    body = await resp.json()
                    assert resp.status == status and body["error"]["message"] == message, (raw[:200], resp.status, body)
                    sent += 1
        return sent

    assert asyncio.run(scenario()) >= 500
