"""A client that disconnects stops its sequence, streamed or not: a real gateway on a loopback port, a real HTTP
client that hangs up mid-generation, and the tokens the engine generated counted (no clock involved)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone
from experts.generate import Sampling
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.slices import ExpertStore
from experts.tokenizer import Tokenizer
from node.backbone.batching import BatchingMoE
from node.gateway.engine import Engine, Finished
from node.gateway.openai import Job
from node.gateway.server import Gateway
from tests.support import async_until, run_bounded

MAX_TOKENS = 120
REQUEST = {"model": "embedded", "prompt": "And God said", "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": 1}


class CountingMoE:
    """The whole model's experts computed locally, counting the layer calls (one per layer per decoded token)."""

    def __init__(self, model: GGUFModel) -> None:
        self.store, self.whole = ExpertStore(model), Partition(((0, model.cfg.n_expert),))
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, layer, x, ids, w):
        with self.lock:
            self.calls += 1
        return grouped_moe(self.store, self.whole, layer, x, ids, w)


async def post(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a POST /v1/completions over a raw connection; the caller reads (or does not) and hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_hangs_up_stops_its_sequence(stream):
    """The same request run to the end gives MAX_TOKENS tokens (finish_reason length); hung up after its first
    tokens, the sequence ends at once: far fewer tokens generated, the slot free again."""
    model = GGUFModel(EMBEDDED_MODEL)
    inner = CountingMoE(model)
    n_layer = model.cfg.n_layer

    async def scenario() -> None:
        moe = BatchingMoE(inner, model.cfg.moe_layers, asyncio.get_running_loop())
        engine = Engine(Backbone(model), Tokenizer.from_spec(model.tokenizer_spec), moe, max_batch=2, speculative=False)
        gateway = Gateway(engine, "embedded", model.digest)
        _, port = await gateway.start("127.0.0.1", 0)
        try:
            reader, writer = await post(port, REQUEST)  # the reference: read the whole answer
            head, _, payload = (await reader.read()).partition(b"\r\n\r\n")
            writer.close()
            assert head.startswith(b"HTTP/1.1 200"), head
            assert json.loads(payload)["usage"]["completion_tokens"] == MAX_TOKENS
            assert engine.stats.active == 0 and engine.stats.completion_tokens == MAX_TOKENS  # booked before its answer

            before = inner.calls
            reader, writer = await post(port, {**REQUEST, "stream": stream})
            await async_until(lambda: inner.calls >= before + 5 * n_layer, timeout=60)  # a few tokens in
            writer.transport.abort()  # hang up, mid-generation
            await async_until(lambda: engine.stats.active == 0, timeout=60)
            generated = engine.stats.completion_tokens - MAX_TOKENS
            assert 4 <= generated < MAX_TOKENS // 2, generated
            assert engine.stats.requests == 2
        finally:
            await gateway.close()
            await asyncio.to_thread(engine.close)

    run_bounded(scenario(), timeout=120)


def test_a_stream_read_to_its_end_is_already_counted():
    """The engine counts a sequence before its stream's last item reaches the client: a caller that has read the
    answer sees its tokens in ``stats`` at once (the statistics page, the mtp test's prefix-cache check)."""
    model = GGUFModel(EMBEDDED_MODEL)
    tok = Tokenizer.from_spec(model.tokenizer_spec)

    async def scenario() -> None:
        moe = BatchingMoE(CountingMoE(model), model.cfg.moe_layers, asyncio.get_running_loop())
        engine = Engine(Backbone(model), tok, moe, max_batch=2, speculative=False)
        try:
            for round_ in range(1, 4):
                stream = await engine.start(Job(tuple(tok.encode("And God said")), 6, Sampling()))
                items = [item async for item in stream]
                assert isinstance(items[-1], Finished), items[-1]
                assert engine.stats.active == 0 and engine.stats.completion_tokens == 6 * round_, engine.stats
        finally:
            await asyncio.to_thread(engine.close)

    run_bounded(scenario(), timeout=120)
