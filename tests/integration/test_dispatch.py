"""Remote dispatch over real QUIC sockets (workers in this process, in-memory discovery): exact, robust."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading

import numpy as np
import pytest
from structlog.testing import capture_logs

from experts.codecs import Codec
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import ExpertRange, GGUFModel
from experts.moe import Partition, grouped_moe, partial_sum
from experts.slices import ExpertStore
from node.backbone import onloop
from node.backbone.dispatch import RemoteMoE
from node.cli.streaming import serial
from node.verdicts import record_verdict
from node.worker.service import Worker
from p2p.connector import Connector
from p2p.dht.discovery import InMemoryBoard, InMemoryDiscovery
from p2p.dht.records import HostedSlice
from p2p.identity import Identity
from p2p.quic.endpoint import Endpoint
from p2p.wire import messages as wire
from tests.support import async_until

from ..conftest import make_model

TOKENS = [264, 72, 101, 108, 108, 111, 44, 32, 116, 104, 101, 114, 101]


class CheatingWorker(Worker):
    """Answers every dispatch with its sums nudged by 1% noise (as tests/doubles/malicious_worker.py, in process)."""

    peers: set[str] = set()  # every cheat's peer id, for the tests to name it

    def __init__(self, identity: Identity, *args, **kw) -> None:
        super().__init__(identity, *args, **kw)
        self.peers.add(str(identity.peer_id))

    async def _compute(self, layer, x, ids, w, held):
        sums = await super()._compute(layer, x, ids, w, held)
        return sums + 0.01 * float(np.abs(sums).mean()) * np.random.default_rng(layer).standard_normal(sums.shape).astype(np.float32)


async def start_swarm(model: GGUFModel, ranges, board, cheats: frozenset[int] = frozenset(), delays=()):
    """Workers for *ranges* on real sockets, announced on *board*; those at the indexes in *cheats* return wrong sums
    (and ask no price while the others ask 1, so a backbone tries them first); the i-th holds each dispatch
    ``delays[i]`` seconds, if given."""
    workers = []
    for i, (a, b) in enumerate(ranges):
        ident = Identity.generate()
        price = 1 if cheats and i not in cheats else 0
        worker = (CheatingWorker if i in cheats else Worker)(ident, ExpertStore(model, experts=ExpertRange(a, b)), price=price, delay=delays[i] if i < len(delays) else 0.0)
        ep = await Endpoint.bind(ident, "127.0.0.1", 0, handler=worker.handle)
        disc = InMemoryDiscovery(ident, board)
        addr = f"127.0.0.1:{ep.local_addr[1]}"
        await disc.announce([HostedSlice(model.digest, layer, ((a, b),), quic_addr=addr, price=price) for layer in model.layers])
        workers.append((worker, ep, disc))
    return workers


@contextlib.asynccontextmanager
async def remote_swarm(model: GGUFModel, ranges, connector_type: type[Connector] = Connector, *, hold_experts: bool = True, cheats: frozenset[int] = frozenset(), delays=(), peers: list | None = None, **moe_kw):
    """Workers for `ranges` on real sockets and a backbone's RemoteMoE that found them (holding the experts itself
    unless *hold_experts* is False); all closed on exit. *peers*, if given, receives the workers' peer ids in the
    order of *ranges*."""
    board = InMemoryBoard()
    workers = await start_swarm(model, ranges, board, cheats, delays)
    if peers is not None:
        peers.extend(w.identity.peer_id for w, _, _ in workers)
    ident = Identity.generate()
    ep = await Endpoint.bind(ident, "127.0.0.1", 0, handler=None)
    cfg = model.cfg
    moe = RemoteMoE(connector_type(ep), InMemoryDiscovery(ident, board), model.digest, cfg.n_embd, cfg.n_ff_exp, cfg.n_expert, ExpertStore(model) if hold_experts else None, loop=asyncio.get_running_loop(), **moe_kw)
    try:
        await moe.refresh(model.layers)
        yield moe
    finally:
        await moe.close()
        await ep.close()
        for w, wep, _ in workers:
            await wep.close()
            w.close()


async def run_remote(model, ranges, codec=Codec.F32, overlap=True):
    async with remote_swarm(model, ranges, codec=codec, timeout=2.0) as moe:
        logits = await asyncio.to_thread(Backbone(model).forward, TOKENS, KVCache(), moe.hook if overlap else serial(moe.hook))
    return logits, moe


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe", "llama"])
def test_f32_remote_logits_are_bit_identical_to_local_grouping(model_dir, arch):
    """Three workers on real sockets give exactly the logits of the local forward with the same grouping."""
    model = GGUFModel(make_model(model_dir, arch, n_expert=12, n_expert_used=4, n_layer=3))
    ranges = [(0, 4), (4, 9), (9, 12)]
    remote, moe = asyncio.run(run_remote(model, ranges))
    store = ExpertStore(model)
    part = Partition(tuple(ranges))
    local = Backbone(model).forward(TOKENS, KVCache(), local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w)))
    assert remote.tobytes() == local.tobytes()
    s = moe.stats.summary()
    assert s["failed_dispatches"] == 0 and s["local_groups"] == 0
    assert len(s["per_peer"]) == 3 and len(moe.receipts) == s["dispatches"]


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_forward_on_the_loops_thread_is_bit_identical_and_hops_no_thread(model_dir, arch, monkeypatch):
    """The forward run on the loop's own thread (``onloop.run_on_loop``) gives the logits of the forward on a thread
    bit for bit, calls its hook on the loop's thread only, and never hands a layer over with run_coroutine_threadsafe
    (qwen2moe: its shared expert overlaps the round trip there too)."""
    model = GGUFModel(make_model(model_dir, arch, n_expert=12, n_expert_used=4, n_layer=3))
    ranges = [(0, 6), (6, 12)]
    threaded, _ = asyncio.run(run_remote(model, ranges))

    def no_hop(*args, **kwargs):
        raise AssertionError("a thread hop on the data path")

    async def on_loop():
        async with remote_swarm(model, ranges, timeout=2.0) as moe:
            threads = set()

            def hook(*args):
                threads.add(threading.get_ident())
                return moe.hook(*args)

            monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", no_hop)
            logits = await onloop.run_on_loop(Backbone(model).forward, TOKENS, KVCache(), hook)
            monkeypatch.undo()
            return logits, moe, threads

    logits, moe, threads = asyncio.run(on_loop())
    assert logits.tobytes() == threaded.tobytes()
    assert threads == {threading.get_ident()}  # asyncio.run's loop runs on this thread
    s = moe.stats.summary()
    assert s["failed_dispatches"] == 0 and s["local_groups"] == 0 and s["dispatches"] == 2 * model.cfg.n_layer


def test_shared_expert_overlap_changes_no_bit(model_dir):
    """Computing the shared expert during the round trip or after it gives the same logits bit for bit, and a layer's
    fan-out time is recorded per number of hosts asked."""
    model = GGUFModel(make_model(model_dir, "qwen2moe", n_expert=12, n_expert_used=4, n_layer=3))
    ranges = [(0, 6), (6, 12)]
    overlapped, moe = asyncio.run(run_remote(model, ranges))
    waited, _ = asyncio.run(run_remote(model, ranges, overlap=False))
    assert overlapped.tobytes() == waited.tobytes()
    layers = moe.stats.summary()["layer_ms"]
    assert sum(v["n"] for v in layers["by_fanout"].values()) == model.cfg.n_layer and set(layers["by_fanout"]) <= {1, 2}


def test_a_layer_starts_its_slowest_round_trip_first(model_dir):
    """The groups of a layer go out in order of their hosts' expected RTT, slowest first (the layer ends with it)."""
    model = GGUFModel(make_model(model_dir, "qwen2moe", n_expert=12, n_expert_used=4, n_layer=1))
    ranges = [(0, 4), (4, 8), (8, 12)]

    started = []

    class Recording(Connector):
        async def request(self, peer, direct, relay, data, **kwargs):
            if wire.decode_header(data).msg_type == wire.MsgType.DISPATCH_REQUEST:  # not the batch signatures asked at close
                started.append(peer)
            return await super().request(peer, direct, relay, data, **kwargs)

    async def main():
        async with remote_swarm(model, ranges, connector_type=Recording) as moe:
            hosts = [moe.router.routes[0].hosts[g][0] for g in range(3)]
            for host, rtt in zip(hosts, (20.0, 80.0, 40.0)):
                moe.router.health[host.peer_id].rtt_ms = rtt
            x = np.random.default_rng(0).standard_normal((1, model.cfg.n_embd)).astype(np.float32)
            ids, w = np.array([[1, 5, 9, 2]]), np.full((1, 4), 0.25, dtype=np.float32)
            await moe.dispatch_layer(0, x, ids, w)
        return started, [hosts[1].peer_id, hosts[2].peer_id, hosts[0].peer_id]

    started, slowest_first = asyncio.run(main())
    assert started == slowest_first


def test_a_late_host_is_hedged_to_the_next_replica_with_exact_sums(model_dir):
    """With --hedge, a group whose (measured fast) host holds the dispatch is also sent to the other replica after
    Router.hedge_after; that replica's answer is used (pinned as the session's host) and equals the local sum, before
    the late host's deadline (which would also have moved the group, with a failure charged)."""
    import structlog

    model = GGUFModel(make_model(model_dir, "qwen2moe", n_expert=12, n_expert_used=4, n_layer=1))
    whole = [(0, 12), (0, 12)]

    async def main():
        peers: list = []
        async with remote_swarm(model, whole, delays=(5.0,), peers=peers, hedge=True, timeout=30.0) as moe:
            late_id, spare_id = peers
            for peer, rtt in ((late_id, 1.0), (spare_id, 20.0)):  # the delayed worker looks fastest: it is asked first
                moe.router.health[peer].rtt_ms, moe.router.health[peer].compute_ms_per_token = rtt, 1.0
            x = np.random.default_rng(1).standard_normal((2, model.cfg.n_embd)).astype(np.float32)
            ids, w = np.array([[1, 5, 9, 2], [0, 3, 7, 11]]), np.full((2, 4), 0.25, dtype=np.float32)
            pins: dict = {}
            with structlog.testing.capture_logs() as logs:
                out = await moe.dispatch_layer(0, x, ids, w, pins)
            return out, x, ids, w, pins, logs, late_id, spare_id

    out, x, ids, w, pins, logs, late_id, spare_id = asyncio.run(main())
    want, _ = partial_sum(ExpertStore(model), 0, x, ids, w, np.ones(ids.shape, bool))
    assert out.tobytes() == want.tobytes()
    assert pins == {(0, (0, 12)): spare_id}
    assert [(e["peer"], e["backup"]) for e in logs if e["event"] == "dispatch.hedged"] == [(str(late_id), str(spare_id))]
    assert not [e for e in logs if e["event"] == "dispatch.failed"]  # answered before the late host's deadline passed


def test_f16_wire_stays_within_the_gate(model_dir):
    """An F16 wire (after its gate passed) stays within cosine 0.999 and the same argmax."""
    model = GGUFModel(make_model(model_dir, "qwen2moe", n_expert=12, n_expert_used=4, n_layer=3))
    record_verdict(model.digest, Codec.F16, "pass")
    remote, _ = asyncio.run(run_remote(model, [(0, 6), (6, 12)], codec=Codec.F16))
    store = ExpertStore(model)
    local = Backbone(model).forward(TOKENS, KVCache(), local_moe(lambda i, x, e, w: grouped_moe(store, Partition(((0, 6), (6, 12))), i, x, e, w)))
    cos = (remote * local).sum(-1) / np.linalg.norm(remote, axis=-1) / np.linalg.norm(local, axis=-1)
    assert cos.min() >= 0.999 and (remote.argmax(-1) == local.argmax(-1)).all()


def test_malformed_frames_leave_the_worker_serving(model_dir):
    """1,000 random and mutated frames each get an error reply; a real dispatch afterwards is still exact."""
    model = GGUFModel(make_model(model_dir, "qwen3moe"))

    async def main():
        async with raw_worker(model) as (worker, send):
            return await send_junk(worker, send)

    async def send_junk(worker, send):
        rng = random.Random(5)
        x = np.ones((1, model.cfg.n_embd), dtype=np.float32)
        good = wire.DispatchRequest(os.urandom(16), wire.model_id_of(bytes.fromhex(model.digest)), 0, Codec.F32, 1, 2, (1, 3), (0.5, 0.25), x.tobytes()).encode()
        codes = set()
        for i in range(1000):
            if i % 2:
                frame = bytearray(good)
                for _ in range(rng.randint(1, 8)):
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
                frame = bytes(frame[: rng.randint(0, len(frame))] if i % 3 == 0 else frame)
            else:
                frame = rng.randbytes(rng.randint(0, 300))
            reply = await send(frame)
            if isinstance(reply, wire.ErrorReply):
                codes.add(reply.code)
            else:
                assert isinstance(reply, (wire.DispatchReply, wire.Pong))
        return codes, worker.stats.errors, await send(good)

    codes, errors, reply = asyncio.run(main())
    assert errors > 500 and wire.ErrorCode.MALFORMED in codes
    x = np.ones((1, model.cfg.n_embd), dtype=np.float32)
    want, _ = partial_sum(ExpertStore(model), 0, x, np.array([[1, 3]]), np.array([[0.5, 0.25]], dtype=np.float32), np.ones((1, 2), bool))
    assert isinstance(reply, wire.DispatchReply) and reply.partial == want.tobytes()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_backbone_holding_no_experts_verifies_by_asking_another_replica(model_dir, replicas):
    """--verify-all without local experts: two replicas cross-check every dispatch (exact logits); a sole replica's
    answers are accepted unverified, and that is logged once."""
    model = GGUFModel(make_model(model_dir, "qwen3moe"))

    async def main():
        async with remote_swarm(model, [(0, 8)] * replicas, hold_experts=False, spot_check=1.0, timeout=2.0) as moe:
            logits = await asyncio.to_thread(Backbone(model).forward, TOKENS, KVCache(), moe.hook)
        return logits, moe

    with capture_logs() as logs:
        logits, moe = asyncio.run(main())
    store = ExpertStore(model)
    local = Backbone(model).forward(TOKENS, KVCache(), local_moe(lambda i, x, e, w: grouped_moe(store, Partition(((0, 8),)), i, x, e, w)))
    assert logits.tobytes() == local.tobytes()
    n_layers = len(model.moe_layers)
    assert moe.checker.checked == n_layers and moe.checker.caught == 0 and not moe.disputes
    unverifiable = [e for e in logs if e["event"] == "spotcheck.unverifiable"]
    if replicas == 1:
        assert moe.checker.unverifiable == n_layers and len(unverifiable) == 1
    else:
        assert moe.checker.unverifiable == 0 and not unverifiable
        assert len(moe.receipts) == 2 * n_layers  # the re-asked replica did the work too, and is paid for it


@pytest.mark.parametrize("honest", [1, 2])
def test_a_cheat_checked_by_replicas_is_caught_only_when_a_third_settles_it(model_dir, honest):
    """--verify-all, no local experts, one cheat: with two honest replicas beside it the cheat is caught wherever it answers
    (as the first host or the re-asked one) and every answer used is right; with one, the disagreement stays unsettled."""
    model = GGUFModel(make_model(model_dir, "qwen3moe"))

    async def main():
        async with remote_swarm(model, [(0, 8)] * (honest + 1), hold_experts=False, cheats=frozenset({0}), spot_check=1.0, timeout=2.0) as moe:
            logits = await asyncio.to_thread(Backbone(model).forward, TOKENS, KVCache(), moe.hook)
        return logits, moe

    with capture_logs() as logs:
        logits, moe = asyncio.run(main())
    store = ExpertStore(model)
    local = Backbone(model).forward(TOKENS, KVCache(), local_moe(lambda i, x, e, w: grouped_moe(store, Partition(((0, 8),)), i, x, e, w)))
    events = [e["event"] for e in logs]
    if honest == 2:
        assert logits.tobytes() == local.tobytes()  # every answer a cheat gave was caught and replaced
        assert moe.checker.caught == 1 and moe.checker.unsettled == 0
        (cheat,) = moe.checker.culprits
        assert cheat in CheatingWorker.peers
        assert all(r.worker != cheat for r in moe.receipts) and {d.receipt.worker for d in moe.disputes} == {cheat}  # unpaid
    else:
        assert moe.checker.caught == 0 and moe.checker.unsettled >= 1 and "spotcheck.unsettled" in events


def test_worker_refuses_to_sign_overflowing_sums(model_dir):
    """Hidden states of 3e38 (finite) overflow the experts' sums: the worker answers INTERNAL, signs nothing, and still serves."""
    model = GGUFModel(make_model(model_dir, "qwen3moe"))

    model_id = wire.model_id_of(bytes.fromhex(model.digest))

    def request(x):
        return wire.DispatchRequest(os.urandom(16), model_id, 0, Codec.F32, 1, 2, (1, 3), (0.5, 0.25), x.tobytes()).encode()

    async def main():
        async with raw_worker(model) as (worker, send):
            refused = await send(request(np.full((1, model.cfg.n_embd), 3e38, dtype=np.float32)))
            served = await send(request(np.ones((1, model.cfg.n_embd), dtype=np.float32)))
            return refused, served, worker.stats

    with np.errstate(over="ignore", invalid="ignore"):
        refused, served, stats = asyncio.run(main())
    assert isinstance(refused, wire.ErrorReply) and refused.code is wire.ErrorCode.INTERNAL and "refusing to sign" in refused.message
    assert isinstance(served, wire.DispatchReply) and np.isfinite(np.frombuffer(served.partial, "<f4")).all()
    assert stats.dispatches == 1 and stats.errors == 1  # only the finite answer was signed


@contextlib.asynccontextmanager
async def raw_worker(model):
    """A worker endpoint serving *model*'s experts and ``send(frame)``: one raw request frame from a fresh client
    endpoint, the decoded reply back (for frames no backbone would build)."""
    ident = Identity.generate()
    worker = Worker(ident, ExpertStore(model))
    wep = await Endpoint.bind(ident, "127.0.0.1", 0, handler=worker.handle)
    cep = await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None)

    async def send(frame: bytes):
        return wire.decode(await cep.request(wep.local_addr, ident.peer_id, frame, timeout=5.0))

    try:
        yield worker, send
    finally:
        await cep.close()
        await wep.close()
        worker.close()


def test_concurrent_backbones_are_batched_into_one_compute_call(model_dir):
    """Requests for one layer from two backbones that arrive during a compute call share the next one, with exact answers."""
    import threading

    model = GGUFModel(make_model(model_dir, "qwen3moe"))
    gate = threading.Event()

    class GatedStore(ExpertStore):
        def weights(self, layer, expert):
            gate.wait(10)  # the first batch holds the compute thread until every request has queued
            return super().weights(layer, expert)

    async def main():
        ident = Identity.generate()
        worker = Worker(ident, GatedStore(model), inline_work=0, inline_alone=False)  # compute on the pool thread, which the gate holds
        wep = await Endpoint.bind(ident, "127.0.0.1", 0, handler=worker.handle)
        clients = [await Endpoint.bind(Identity.generate(), "127.0.0.1", 0, handler=None) for _ in range(2)]
        rng = np.random.default_rng(0)
        reqs = []
        for i in range(8):
            x = rng.standard_normal((2, model.cfg.n_embd)).astype(np.float32)
            ids = np.array([[i % 8, (i + 3) % 8], [(i + 1) % 8, (i + 5) % 8]])
            w = rng.random((2, 2)).astype(np.float32)
            msg = wire.DispatchRequest(os.urandom(16), wire.model_id_of(bytes.fromhex(model.digest)), 1, Codec.F32, 2, 2, tuple(int(v) for v in ids.ravel()), tuple(float(v) for v in w.ravel()), x.tobytes())
            reqs.append((x, ids, w, msg.encode()))
        try:
            tasks = [asyncio.create_task(clients[i % 2].request(wep.local_addr, ident.peer_id, r[3], timeout=20)) for i, r in enumerate(reqs)]
            await async_until(lambda: sum(len(v) for v in worker._pending.values()) >= len(reqs) - 1, timeout=20, interval=0.01)
            gate.set()
            replies = [wire.decode(r) for r in await asyncio.gather(*tasks)]
            return reqs, replies, worker.stats
        finally:
            for c in clients:
                await c.close()
            await wep.close()
            worker.close()

    reqs, replies, stats = asyncio.run(main())
    store = ExpertStore(model)
    for (x, ids, w, _), reply in zip(reqs, replies):
        want, _ = partial_sum(store, 1, x, ids, w.astype(np.float32), np.ones_like(ids, dtype=bool))
        assert reply.partial == want.tobytes()
    assert stats.dispatches == 8 and stats.batches == 2 and len(stats.by_peer) == 2


def test_hot_local_experts_are_exact_and_used(model_dir):
    """With the backbone keeping its 3 hottest experts per layer, logits equal the local path with the same hot sets
    bit for bit, greedy tokens equal those without hot-local, and the local hit rate is reported."""
    from experts.generate import generate
    from experts.moe import hot_grouped_moe
    from node.backbone.hot import HotExperts

    model = GGUFModel(make_model(model_dir, "qwen2moe", n_expert=12, n_expert_used=4, n_layer=3))
    ranges = [(0, 6), (6, 12)]

    async def main():
        hot = HotExperts(model.cfg.n_layer, model.cfg.n_expert, 3)
        async with remote_swarm(model, ranges, hot=hot) as moe:
            return await asyncio.to_thread(lambda: list(generate(Backbone(model), TOKENS, 24, moe.hook))), hot

    remote, hot = asyncio.run(main())
    store, part = ExpertStore(model), Partition(tuple(ranges))
    ref_hot = HotExperts(model.cfg.n_layer, model.cfg.n_expert, 3)

    def local_hot(i, x, e, w):
        out = hot_grouped_moe(store, part, ref_hot.hot(i), i, x, e, w)
        ref_hot.observe(i, e)
        return out

    local = list(generate(Backbone(model), TOKENS, 24, local_moe(local_hot)))
    plain = [t for t, _ in generate(Backbone(model), TOKENS, 24, local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w)))]
    assert all(a[1].tobytes() == b[1].tobytes() for a, b in zip(remote, local))
    assert [t for t, _ in remote] == plain
    assert 0 < hot.hit_rate < 1
