"""The OpenAI-compatible gateway over a real local swarm, driven by the unmodified `openai` client."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.generate import Sampling
from experts.gguf_model import GGUFModel
from experts.moe import Partition
from experts.tokenizer import Tokenizer
from node.gateway.openai import CHAT_STOP, render_chat
from node.launcher import Cluster
from tests.support import until
from tests.support.engine import local_completion, local_engine

pytestmark = pytest.mark.slow
MODEL = "embedded"
LOOPBACK_DATAGRAM = "16384"
PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "And it came to pass", "Blessed are the meek", "Let there be light", "Thus saith the LORD", "Hear, O Israel"]
SAMPLED = {2: (0.9, 0.95, 11), 5: (1.1, 1.0, 12)}  # session -> (temperature, top_p, seed); the rest are greedy


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap node, three workers (a third of every layer's experts each) and the gateway, as processes."""
    model = GGUFModel(EMBEDDED_MODEL)
    part = Partition.even(model.cfg.n_expert, 3)
    with Cluster(tmp_path_factory.mktemp("gateway")) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        workers = [cluster.start(f"w{i}", "worker", "--model", str(model.path), "--experts", f"{a}-{b - 1}", "--bootstrap", boot, "--max-datagram", LOOPBACK_DATAGRAM) for i, (a, b) in enumerate(part.bounds)]
        for w in workers:
            w.wait_ready()
        gw = cluster.start("gateway", "backbone", "serve", "--bootstrap", boot, "--http", "127.0.0.1:0", "--max-datagram", LOOPBACK_DATAGRAM, "--max-batch", "8").wait_ready()
        yield {"url": gw["base_url"], "model": model, "part": part, "tok": Tokenizer.from_spec(model.tokenizer_spec)}


@pytest.fixture(scope="module")
def local(swarm):
    """Text that single-process `generate` gives with the workers' expert grouping, cut as the gateway cuts it."""
    engine = local_engine(swarm["model"])
    return functools.partial(local_completion, engine, swarm["tok"], swarm["part"])


@pytest.fixture
def client(swarm) -> openai.OpenAI:
    return openai.OpenAI(base_url=swarm["url"], api_key="unused", max_retries=0, timeout=60)


def stats(swarm) -> dict:
    return httpx.get(swarm["url"] + "/stats").json()


def test_completions_equal_local_generate_plain_and_streamed(swarm, client, local):
    """A greedy completion (decoded speculatively) is the text local `generate` gives; streamed chunks add up to it."""
    assert [m.id for m in client.models.list()] == [MODEL]
    want, n = local("And God said", 24)
    r = client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(swarm["tok"].encode("And God said")), n)
    chunks = list(client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_chat_uses_the_template_and_stops_before_the_next_user_turn(swarm, client, local):
    """Chat renders 'Role: text' lines then 'Assistant:'; plain and streamed answers equal the local run of that prompt."""
    messages = [{"role": "system", "content": "Speak as the preacher."}, {"role": "user", "content": "What profit hath a man?"}]
    want, _ = local(render_chat(messages), 40, stops=(CHAT_STOP, "."))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=".")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ("stop" if r.usage.completion_tokens < 40 else "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=".", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_eight_concurrent_sessions_get_their_solo_texts_with_fewer_dispatches(swarm, client, local):
    """Eight sessions (greedy and seeded sampling) at once give exactly their one-at-a-time texts, in fewer dispatches."""

    def ask(i: int) -> str:
        t, p, seed = SAMPLED.get(i, (0.0, 1.0, 0))
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=t, top_p=p, seed=seed, user=f"session-{i}")
        return r.choices[0].text

    s0 = stats(swarm)
    alone = [ask(i) for i in range(8)]
    s1 = stats(swarm)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    s2 = stats(swarm)
    assert together == alone
    for i in (0, *SAMPLED):
        t, p, seed = SAMPLED.get(i, (0.0, 1.0, 0))
        assert alone[i] == local(PROMPTS[i], 16, Sampling(t, p, seed))[0]
    solo_dispatches = s1["dispatch"]["dispatches"] - s0["dispatch"]["dispatches"]
    batched_dispatches = s2["dispatch"]["dispatches"] - s1["dispatch"]["dispatches"]
    assert batched_dispatches < solo_dispatches
    calls = s2["batching"]["member_calls"] - s1["batching"]["member_calls"]
    assert s2["batching"]["layer_dispatches"] - s1["batching"]["layer_dispatches"] < calls
    assert s2["dispatch"]["failed_dispatches"] == 0 and s2["requests"]["failed"] == 0


def test_a_resent_chat_history_reuses_the_cached_prefix(swarm, client, local):
    """The second turn of a session starts from the first turn's KV: cached tokens reported, output unchanged."""
    session = {"X-Session-Id": "prefix-test"}
    messages = [{"role": "user", "content": "Who divided the waters?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_headers=session)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hits = stats(swarm)["prefix_cache"]["hits"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And the light?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_headers=session)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert stats(swarm)["prefix_cache"]["hits"] == hits + 1
    assert second.choices[0].message.content == local(render_chat(messages), 12, stops=(CHAT_STOP,))[0]
    other = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, user="someone-else")
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # prefixes are per session


def test_bad_requests_get_openai_style_errors(swarm, client):
    """Unsupported or invalid parameters give 4xx with an OpenAI error object naming the parameter."""
    cases = [
        (openai.BadRequestError, dict(n=2), "n"),
        (openai.BadRequestError, dict(temperature=3.5), "temperature"),
        (openai.BadRequestError, dict(max_tokens=5000), "max_tokens"),
        (openai.BadRequestError, dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (openai.BadRequestError, dict(logprobs=3), "logprobs"),
        (openai.NotFoundError, dict(model="gpt-4"), "model"),
    ]
    for exc, kw, param in cases:
        with pytest.raises(exc) as err:
            client.completions.create(**{"model": MODEL, "prompt": "And", **kw})
        assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error", kw
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="And", max_tokens=5000)
    assert err.value.body["code"] == "context_length_exceeded"
    r = httpx.post(swarm["url"] + "/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(swarm["url"] + "/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert stats(swarm)["requests"]["active"] == 0


def test_a_client_that_leaves_mid_stream_stops_its_sequence(swarm, client):
    """Closing a stream after its first chunk (a chat stream's role chunk, sent at once: text is held until it is
    final) ends the sequence long before max_tokens; its slot is free again."""
    before = stats(swarm)["requests"]
    with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "And God said"}], max_tokens=400, temperature=0.7, seed=1, stream=True) as s:
        next(iter(s))
    until(lambda: not stats(swarm)["requests"]["active"], timeout=60, interval=0.1, what="the sequence ended")
    now = stats(swarm)["requests"]
    assert now["active"] == 0 and now["requests"] == before["requests"] + 1
    assert now["completion_tokens"] - before["completion_tokens"] < 100
