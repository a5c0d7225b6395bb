"""Continuous batching, the prefix cache and the gateway's request handling, in one process (no network)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, KVCache, local_moe
from experts.generate import Sampling, generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.slices import ExpertStore
from experts.speculative import speculative_generate
from experts.tokenizer import Tokenizer
from node.backbone.batching import BatchingError, BatchingMoE, LayerBatcher, Phase, affinity_groups
from node.backbone.prefix_cache import PrefixCache
from node.backbone.routing import Router
from node.gateway.engine import HeldText
from node.gateway.openai import CHAT_STOP, ApiError, Finished, Reply, StopMatcher, parse_job, parse_request, render_chat, sse
from p2p.dht.records import HostedSlice, HostRecord
from p2p.identity import Identity

W = 0.002  # batching window in the LayerBatcher tests


def members_of(batches) -> list[tuple[int, list]]:
    return [(b.layer, b.members) for b in batches]


# --- LayerBatcher: when a layer's batch closes -----------------------------------------------------


def test_aligned_members_close_when_the_last_arrives():
    """Two sequences in step: each layer's batch waits for the second and then holds both, in arrival order."""
    lb = LayerBatcher(n_layers=2, window_s=W)
    lb.join("a")
    lb.join("b")
    assert lb.arrive("a", 0, now=0.0) == []
    assert members_of(lb.arrive("b", 0, now=0.0005)) == [(0, ["a", "b"])]
    assert lb.answered(["a", "b"], now=0.001) == []
    assert lb.arrive("b", 1, now=0.0011) == []  # a is still computing its way to layer 1
    assert members_of(lb.arrive("a", 1, now=0.0012)) == [(1, ["b", "a"])]
    lb.answered(["a", "b"], now=0.002)
    assert lb.members["a"].phase is Phase.BETWEEN and lb.members["b"].phase is Phase.BETWEEN


def test_a_straggler_is_left_behind_after_the_window():
    """Mid-forward, a batch waits for a computing member at most the window, then goes without it."""
    lb = LayerBatcher(n_layers=3, window_s=W)
    for m in "ab":
        lb.join(m)
    lb.arrive("a", 0, 0.0)
    lb.arrive("b", 0, 0.0)
    lb.answered(["a", "b"], 0.001)
    assert lb.arrive("a", 1, 0.0012) == []
    assert lb.next_deadline() == pytest.approx(0.0012 + W)
    assert lb.poll(0.0012 + W / 2) == []
    assert members_of(lb.poll(0.0012 + W)) == [(1, ["a"])]
    # b arrives late; nobody else is computing towards layer 1, so it goes at once, alone.
    assert members_of(lb.arrive("b", 1, 0.004)) == [(1, ["b"])]


def test_each_arrival_extends_the_window():
    """The window is an idle timeout: members trickling in (GIL, two cores) keep the batch open."""
    lb = LayerBatcher(n_layers=2, window_s=W)
    for m in "abc":
        lb.join(m)
    lb.arrive("a", 0, 0.0)
    lb.arrive("b", 0, 0.0015)
    assert lb.poll(0.003) == [] and lb.next_deadline() == pytest.approx(0.0015 + W)
    assert members_of(lb.arrive("c", 0, 0.003)) == [(0, ["a", "b", "c"])]


def test_a_layer_does_not_wait_for_members_behind_it():
    """Mid-forward, a member still at an earlier layer cannot join this one: the batch closes without waiting."""
    lb = LayerBatcher(n_layers=4, window_s=W)
    for m in "ab":
        lb.join(m)
    lb.arrive("a", 0, 0.0)
    lb.arrive("b", 0, 0.0)
    lb.answered(["a", "b"], 0.001)
    lb.arrive("a", 1, 0.001)
    assert members_of(lb.poll(0.001 + W)) == [(1, ["a"])]  # b computes on (a long prefill, say)
    assert members_of(lb.arrive("b", 1, 0.004)) == [(1, ["b"])]
    lb.answered(["a"], 0.005)
    assert members_of(lb.arrive("a", 2, 0.005)) == [(2, ["a"])]  # b is in flight at layer 1, behind a


def test_step_barrier_admits_a_new_sequence_at_the_next_step():
    """A newcomer waits at layer 0 (no deadline) while others are inside a forward, then starts the next step with them."""
    lb = LayerBatcher(n_layers=2, window_s=W)
    lb.join("old")
    assert members_of(lb.arrive("old", 0, 0.0)) == [(0, ["old"])]
    lb.answered(["old"], 0.001)
    lb.join("new")
    assert lb.arrive("new", 0, 0.0012) == []
    assert lb.next_deadline() is None  # old is mid-forward: wait for it, however long
    assert lb.poll(1.0) == []
    assert members_of(lb.arrive("old", 1, 1.0)) == [(1, ["old"])]
    assert lb.answered(["old"], 1.001) == []  # old is sampling: give it the window after its forward ended
    assert lb.next_deadline() == pytest.approx(1.001 + W)
    assert members_of(lb.arrive("old", 0, 1.0015)) == [(0, ["new", "old"])]


def test_step_start_goes_after_the_window_when_a_member_dawdles_between_steps():
    """Nobody inside a forward: the step-start batch waits the window for the sampling members, then goes."""
    lb = LayerBatcher(n_layers=2, window_s=W)
    lb.join("a")
    lb.join("b")
    lb.arrive("a", 0, 5.0)
    assert lb.next_deadline() == pytest.approx(5.0 + W)
    assert members_of(lb.poll(5.0 + W)) == [(0, ["a"])]


def test_leaving_unblocks_the_others():
    """A finished sequence leaves; a batch that waited for it closes."""
    lb = LayerBatcher(n_layers=2, window_s=W)
    lb.join("a")
    lb.join("b")
    lb.arrive("a", 0, 0.0)
    assert members_of(lb.leave("b", 0.0001)) == [(0, ["a"])]
    assert lb.leave("b", 0.0002) == []  # twice is harmless


def test_calls_out_of_turn_are_refused():
    """A member must call layers in order, one at a time."""
    lb = LayerBatcher(n_layers=3, window_s=W)
    lb.join("a")
    with pytest.raises(BatchingError):
        lb.arrive("a", 1, 0.0)
    lb.arrive("a", 0, 0.0)
    with pytest.raises(BatchingError):
        lb.arrive("a", 1, 0.0)  # its layer-0 call has not been answered
    with pytest.raises(BatchingError):
        lb.join("a")


# --- slot affinity -------------------------------------------------------------------------------------


def test_a_pinned_host_goes_first_while_it_is_ready():
    """Router.candidates puts the session's pinned replica first, unless it is benched."""
    a, b = Identity.generate(), Identity.generate()
    router = Router(n_expert=8)
    router.update(0, [HostRecord(i.peer_id, HostedSlice("ab" * 32, 0, ((0, 8),), quic_addr=f"127.0.0.1:{p}"), 1000, 2000, 1) for i, p in ((a, 1), (b, 2))])
    for peer, rtt in ((a.peer_id, 5.0), (b.peer_id, 20.0)):
        router.started(peer)
        router.succeeded(peer, rtt)
    assert [h.peer_id for h in router.candidates(0, 0, 0.0)] == [a.peer_id, b.peer_id]
    assert [h.peer_id for h in router.candidates(0, 0, 0.0, prefer=b.peer_id)] == [b.peer_id, a.peer_id]
    router.started(b.peer_id)
    router.failed(b.peer_id, now=0.0)
    assert [h.peer_id for h in router.candidates(0, 0, 0.5, prefer=b.peer_id)] == [a.peer_id, b.peer_id]


def test_a_batch_splits_only_where_sessions_pin_different_hosts():
    """Members whose pins agree (or who have none) share a dispatch; a conflicting pin gets its own."""
    g0, g1 = (0, (0, 16)), (0, (16, 32))
    pins = {"a": {g0: "h1"}, "b": None, "c": {g0: "h1", g1: "h3", (1, (0, 16)): "h9"}, "d": {g0: "h2"}, "e": {g1: "h3"}}
    groups = affinity_groups(0, ["a", "b", "c", "d", "e"], pins)
    assert groups == [(["a", "b", "c", "e"], {g0: "h1", g1: "h3"}), (["d"], {g0: "h2"})]


# --- BatchingMoE over the embedded model: exact, and fewer dispatches --------------------------------


@pytest.fixture(scope="module")
def embedded():
    model = GGUFModel(EMBEDDED_MODEL)
    return model, Backbone(model), ExpertStore(model), Tokenizer.from_spec(model.tokenizer_spec)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


class CountingMoE:
    """A local grouped MoE that counts its calls (thread-safe) and the rows it saw."""

    def __init__(self, store, part):
        self.store, self.part = store, part
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, layer, x, ids, w):
        with self.lock:
            self.calls += 1
        return grouped_moe(self.store, self.part, layer, x, ids, w)


PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "And it came to pass", "Blessed are the meek", "Let there be light"]
SAMPLED = {1: Sampling(temperature=0.9, top_p=0.9, seed=7), 4: Sampling(temperature=1.2, seed=3)}


def decode(backbone, tok, i, hook, n=12):
    ids = tok.encode(PROMPTS[i])
    s = SAMPLED.get(i)
    steps = generate(backbone, ids, n, hook, sampling=s) if s else speculative_generate(backbone, ids, n, hook)
    return [(t, row.tobytes()) for t, row in steps]


def test_concurrent_sequences_get_the_bits_they_get_alone_with_fewer_dispatches(embedded, loop):
    """Six sequences (greedy speculative and sampled) decoded at once through one BatchingMoE equal their solo runs."""
    model, bb, store, tok = embedded
    inner = CountingMoE(store, Partition.even(model.cfg.n_expert, 3))
    alone = [decode(bb, tok, i, local_moe(inner)) for i in range(len(PROMPTS))]
    solo_calls = inner.calls
    inner.calls = 0
    moe = BatchingMoE(inner, model.cfg.moe_layers, loop, window_s=0.005)

    def run(i):
        with moe.member() as hook:
            return decode(bb, tok, i, hook)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(run, range(len(PROMPTS))))
    assert together == alone
    assert moe.stats.member_calls == solo_calls
    assert inner.calls == moe.stats.dispatches < solo_calls / 2
    # Members leave through call_soon_threadsafe: a callback queued after theirs is a barrier (FIFO on the loop).
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)
    assert not moe.core.members and not moe.core.open


def test_a_failed_dispatch_fails_every_member_of_the_batch(embedded, loop):
    """The inner dispatch raising reaches each waiting sequence as its exception; none hangs."""
    model, bb, _, tok = embedded

    def broken(layer, x, ids, w):
        raise RuntimeError("no host")

    moe = BatchingMoE(broken, model.cfg.moe_layers, loop)

    def run(i):
        with moe.member() as hook:
            with pytest.raises(RuntimeError, match="no host"):
                list(generate(bb, tok.encode(PROMPTS[i]), 4, hook))

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(run, range(3)))


# --- prefix cache -----------------------------------------------------------------------------------


def fake_cache(n, layers=2, width=4, fill=1.0) -> KVCache:
    return KVCache([np.full((n, 1, width), fill + i, np.float32) for i in range(layers)], [np.full((n, 1, width), -fill - i, np.float32) for i in range(layers)])


def test_lookup_returns_the_longest_prefix_and_leaves_a_token_to_feed():
    """The longest common prefix of any entry in the namespace is reused; never the whole prompt."""
    pc = PrefixCache(1 << 20)
    pc.store(None, [1, 2, 3, 4, 5], fake_cache(5))
    pc.store(None, [1, 2, 9], fake_cache(3, fill=7.0))
    got, _ = pc.lookup(None, [1, 2, 3, 4, 6, 7])
    assert got.n_past == 4 and got.k[0][0, 0, 0] == 1.0
    assert pc.lookup(None, [1, 2, 3, 4, 5])[0].n_past == 4  # the last token must still be fed
    assert pc.lookup(None, [1, 2, 9, 9])[0].k[1][0, 0, 0] == 8.0
    assert pc.lookup(None, [8, 1, 2])[0].n_past == 0
    assert pc.lookup("someone else", [1, 2, 3, 4, 6])[0].n_past == 0
    s = pc.summary()
    assert (s["lookups"], s["hits"], s["reused_tokens"]) == (5, 3, 11)


def test_lookup_stops_before_the_first_position_of_a_caught_host():
    """An entry is reused only up to the first position that used a host caught since, and its taint travels on."""
    pc = PrefixCache(1 << 20)
    pc.store(None, [1, 2, 3, 4, 5, 6], fake_cache(6), taint={"cheat": 3, "other": 1, "late": 5})
    cache, taint = pc.lookup(None, [1, 2, 3, 4, 5, 6, 7])
    assert cache.n_past == 6 and taint == {"cheat": 3, "other": 1, "late": 5}  # nobody caught yet
    cache, taint = pc.lookup(None, [1, 2, 3, 4, 5, 6, 7], culprits=["cheat"])
    assert cache.n_past == 3 and taint == {"other": 1}


def test_store_keeps_bytes_under_the_budget_least_recently_used_first():
    """Entries are evicted in LRU order to stay within max_bytes; a longer sequence replaces its own prefix."""
    one = sum(a.nbytes for a in fake_cache(4).k + fake_cache(4).v)
    pc = PrefixCache(2 * one)
    pc.store("s", [1, 2, 3, 4], fake_cache(4))
    pc.store("s", [5, 6, 7, 8], fake_cache(4))
    pc.lookup("s", [1, 2, 3, 0])  # touch the first
    pc.store("s", [9, 9, 9, 9], fake_cache(4))
    assert pc.lookup("s", [5, 6, 7, 0])[0].n_past == 0
    assert pc.lookup("s", [1, 2, 3, 0])[0].n_past == 3
    pc.store("s", [1, 2, 3, 4, 5, 6], fake_cache(6))  # covers [1, 2, 3, 4], which goes
    assert pc.summary()["entries"] == 1 and pc.summary()["bytes"] <= 2 * one
    pc.store("s", [1, 2, 3], fake_cache(3))  # already covered: nothing new
    assert pc.summary()["stored"] == 4
    pc.store("s", [1, 2, 3] + [0] * 17, fake_cache(20))  # larger than the budget: not kept
    assert pc.lookup("s", [1, 2, 3] + [0] * 17)[0].n_past == 3


def test_resuming_from_a_cached_prefix_is_bit_identical(embedded):
    """A chat resent with one more message decodes from the cached KV to the same tokens and logits."""
    model, bb, store, tok = embedded
    moe = local_moe(lambda i, x, e, w: grouped_moe(store, Partition.even(model.cfg.n_expert, 2), i, x, e, w))
    pc = PrefixCache(1 << 24)
    first = tok.encode("User: Who made the heaven?\nAssistant:")
    cache, _ = pc.lookup("s", first)
    out1 = [t for t, _ in generate(bb, first, 8, moe, cache=cache)]
    pc.store("s", first + out1, cache)
    second = first + out1 + tok.encode("\nUser: And the earth?\nAssistant:")
    prefix, _ = pc.lookup("s", second)
    assert prefix.n_past == len(first) + len(out1) - 1  # the last generated token was never fed
    resumed = list(speculative_generate(bb, second, 10, moe, cache=prefix))
    full = list(speculative_generate(bb, second, 10, moe))
    assert [(t, r.tobytes()) for t, r in resumed] == [(t, r.tobytes()) for t, r in full]


# --- gateway request handling ------------------------------------------------------------------------


def test_stop_strings_are_held_back_until_they_cannot_match():
    """Text that may start a stop string is withheld; at the stop, only what precedes it is emitted."""
    m = StopMatcher(["\nUser:", "END"])
    assert m.push("Hello\nUs") == ("Hello", False)
    assert m.push("ually") == ("\nUsually", False)
    assert m.push(" E") == (" ", False)
    assert m.push("N") == ("", False)
    assert m.push("D and more") == ("", True)
    m = StopMatcher(["xy"])
    assert m.push("abx") == ("ab", False) and m.flush() == "x"


def test_held_text_sends_only_final_tokens_and_survives_a_rollback(embedded):
    """Text waits until its tokens are final; a rollback past the sent part replays the kept tokens (nothing sent
    twice, the rest held again); a stop string ends the text, and a rollback before it takes the stop back."""
    _, _, _, tok = embedded
    first, other = tok.encode(" And God said unto Moses"), tok.encode(" the LORD spake")
    text = HeldText(tok, ["Moses"])
    for t in first[:3]:
        text.push(t)
    assert text.release(0) == [] and text.finish is None
    sent = text.release(2)
    assert "".join(sent) == tok.decode(first[:2])
    assert text.release(2) == []  # once
    for t in first[3:]:
        text.push(t)
    assert text.finish == "stop"  # "Moses" reached, tentatively
    text.retract(3)  # a catch: the tokens after the third go; the first two were final and stay sent
    assert text.finish is None and text.tokens == first[:3]
    for t in other:
        text.push(t)
    rest = text.release(len(text.tokens)) + [text.tail()]
    assert "".join(sent + rest) == tok.decode(first[:3] + other)


def test_chat_template_and_request_validation(embedded):
    """Messages render as 'Role: text' lines; bad parameters are refused with the parameter named."""
    _, _, _, tok = embedded
    prompt = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert prompt == "System: Be brief.\nUser: Hi\nAssistant:"
    job = parse_job({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stop": "END", "seed": 5}, chat=True, tok=tok, context_length=512, session="s")
    assert job.stop == ("END", CHAT_STOP) and job.sampling == Sampling(0.0, 1.0, 5) and job.max_tokens == 512 - len(job.prompt)
    job = parse_job({"prompt": [5, 6, 7]}, chat=False, tok=tok, context_length=512, session=None)
    assert job.prompt == (5, 6, 7) and job.max_tokens == 16
    bad = [
        ({"prompt": "x", "n": 2}, "n", 400),
        ({"prompt": "x", "temperature": 3}, "temperature", 400),
        ({"prompt": "x", "top_p": 0}, "top_p", 400),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
        ({"prompt": "x", "max_tokens": 600}, "max_tokens", 400),
        ({"prompt": "x", "stop": ["a", ""]}, "stop", 400),
        ({"prompt": "x", "logprobs": 2}, "logprobs", 400),
        ({"prompt": ["a", "b"]}, "prompt", 400),
        ({"prompt": [1, 5000]}, "prompt", 400),
        ({"prompt": "x", "seed": True}, "seed", 400),
    ]
    for body, param, status in bad:
        with pytest.raises(ApiError) as err:
            parse_job(body, chat=False, tok=tok, context_length=512, session=None)
        assert (err.value.param, err.value.status) == (param, status), body
    with pytest.raises(ApiError) as err:
        parse_job({"messages": [{"role": "robot", "content": "x"}]}, chat=True, tok=tok, context_length=512, session=None)
    assert err.value.param == "messages[0].role"


def test_requests_name_the_model_and_session_and_replies_take_openai_shapes(embedded):
    """A request for another model is a 404 and the header beats 'user' as session; bodies, chunks and events are OpenAI's."""
    _, _, _, tok = embedded
    with pytest.raises(ApiError) as err:
        parse_request({"model": "gpt-4", "prompt": "x"}, chat=False, served="m", tok=tok, context_length=512, session_header=None)
    assert (err.value.status, err.value.param) == (404, "model")
    body = {"model": "m", "prompt": "x", "user": "u"}
    assert parse_request(body, chat=False, served="m", tok=tok, context_length=512, session_header="h").session == "h"
    assert parse_request(body, chat=False, served="m", tok=tok, context_length=512, session_header=None).session == "u"
    with pytest.raises(ApiError) as err:
        parse_request({**body, "stream_options": {"include_usage": True}}, chat=False, served="m", tok=tok, context_length=512, session_header=None)
    assert err.value.param == "stream_options"
    done = Finished("stop", prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    chat = Reply.new({"stream": True, "stream_options": {"include_usage": True}}, chat=True, model="m", fingerprint="fp_x")
    assert chat.id.startswith("chatcmpl-") and chat.head["object"] == "chat.completion.chunk" and chat.head["system_fingerprint"] == "fp_x"
    assert chat.chunk(None, role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk("hi")["choices"][0]["delta"] == {"content": "hi"} and chat.chunk("hi")["usage"] is None
    assert chat.chunk(None, "stop")["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert chat.usage_chunk(done)["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    assert chat.body("hello", done)["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    text = Reply.new({}, chat=False, model="m", fingerprint="fp_x")
    assert text.id.startswith("cmpl-") and "usage" not in text.chunk("x") and text.chunk("x")["choices"][0]["text"] == "x"
    assert text.body("hello", done)["object"] == "text_completion" and text.body("hello", done)["choices"][0]["text"] == "hello"
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and sse("[DONE]") == b"data: [DONE]\n\n"
