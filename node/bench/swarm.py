"""`moeswarm bench swarm`'s measurement: a local swarm of real processes vs the same model decoding on its own.

What a user sees after `moeswarm demo`: a bootstrap node and workers (each holding an equal share of every layer's
experts, one thread each) started the demo's way, a backbone here with one kernel thread, the user's defaults
(ledger on the backbone, the default spot checks, F32 wire). The same prompt is decoded locally and through the
swarm in alternating rounds, so drifting machine load hits both alike; medians of tokens/s are reported.

Without ``--model`` the model is a random one cached under ``$MOESWARM_HOME/models`` (written once, streamed), so a
second run starts in seconds and every run with the same options measures the same bytes.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from experts.embedded import DEFAULT_PROMPT
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.home import moeswarm_home
from experts.hosting import open_experts
from experts.kernels import make_kernel
from experts.moe import Partition, grouped_moe
from experts.random_model import random_config, write_random_model
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.bench.common import BenchmarkError, overhead_ms_p50
from node.launcher import LOOPBACK_DATAGRAM, Cluster, start_local_swarm
from p2p.identity import Identity

# The default swarm: a Qwen3-30B-A3B-like router (64 experts, top-8) at half its width, 12 MoE layers.
SHAPE = dict(arch="qwen3moe", n_embd=1024, n_head=16, n_head_kv=4, n_expert=64, n_expert_used=8, n_ff_exp=512)
QTYPE = "Q4_K"


def cached_model(n_layer: int, shape: dict | None = None, qtype: str = QTYPE) -> Path:
    """The random model of *n_layer* layers and *shape* (default :data:`SHAPE`), written on first use to the cache.

    Written to a temporary name and renamed, so an interrupted write never leaves a file the next run trusts."""
    shape = {**SHAPE, **(shape or {})}
    name = "random-{arch}-L{n}-h{n_embd}-e{n_expert}k{n_expert_used}-f{n_ff_exp}-{qtype}-s0.gguf".format(n=n_layer, qtype=qtype, **shape)
    path = moeswarm_home() / "models" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".writing-{os.getpid()}-{path.name}")
        try:
            write_random_model(tmp, random_config(n_layer=n_layer, **shape), qtype=gguf.GGMLQuantizationType[qtype])
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def run(model_path: Path, n_workers: int, n_tokens: int, rounds: int) -> dict:
    """Start the swarm, decode *n_tokens* locally and through it in *rounds* alternating rounds (after one warm-up
    each), stop every process, and return the medians and the per-dispatch split."""
    load_start = os.getloadavg()
    model = GGUFModel(model_path)
    cfg = model.cfg
    if not 1 <= n_workers <= cfg.n_expert:
        raise BenchmarkError(f"--workers must be between 1 and the model's {cfg.n_expert} experts; got {n_workers}")
    kernel = make_kernel("ggml", 1)  # the backbone's and the local run's; each worker has its own, one thread
    part = Partition.even(cfg.n_expert, n_workers)
    bb = Backbone(model, kernel)
    store, _ = open_experts(model, kernel)
    store.warm()
    local_hook = local_moe(lambda i, x, e, w: grouped_moe(store, part, i, x, e, w))  # the workers' grouping: same bits
    prompt = Tokenizer.from_spec(model.tokenizer_spec).encode(DEFAULT_PROMPT)

    def decode(hook) -> tuple[list[int], float]:
        t = time.perf_counter()
        toks = [tok for tok, _ in generate(bb, prompt, n_tokens, hook)]
        return toks, len(toks) / (time.perf_counter() - t)

    with tempfile.TemporaryDirectory(prefix="moeswarm-bench-swarm-") as tmp, Cluster(Path(tmp) / "nodes") as cluster:
        boot, workers = start_local_swarm(cluster, model.path, part.bounds, kernel="ggml", max_datagram=LOOPBACK_DATAGRAM, ready_timeout=600)

        async def alternate():
            async with backbone_session(Identity.generate(), model, boot["dht_addrs"], kernel, BackboneOptions(max_datagram=LOOPBACK_DATAGRAM, ledger_path=Path(tmp) / "backbone-ledger.sqlite")) as moe:
                await wait_for_hosts(moe, model.moe_layers, 1, 60)
                await asyncio.to_thread(decode, local_hook)  # warm-up: caches, connections, RTT estimates
                await asyncio.to_thread(decode, moe.hook)
                moe.stats.records.clear()
                local, swarm = [], []
                for _ in range(rounds):
                    local.append(await asyncio.to_thread(decode, local_hook))
                    swarm.append(await asyncio.to_thread(decode, moe.hook))
                return local, swarm, moe.stats.summary(), overhead_ms_p50(moe.stats.records), moe.checker.summary()

        local, swarm, stats, overhead, checks = asyncio.run(alternate())
    local_tps = float(np.median([tps for _, tps in local]))
    swarm_tps = float(np.median([tps for _, tps in swarm]))
    return {
        "model": str(model.path),
        "config": {"arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_expert": cfg.n_expert, "n_expert_used": cfg.n_expert_used, "n_ff_exp": cfg.n_ff_exp},
        "moe_layers": len(model.moe_layers),
        "workers": n_workers,
        "threads": {"backbone": 1, "worker": 1},
        "session": {"wire": "f32", "ledger": True, "spot_check_rate": checks["spot_check"], "spot_checked": checks["checked"], "caught": checks["caught"]},
        "tokens": n_tokens,
        "rounds": rounds,
        "decode": {"local_tps": round(local_tps, 3), "swarm_tps": round(swarm_tps, 3), "ratio": round(swarm_tps / local_tps, 3)},
        "identical": all(toks == local[0][0] for toks, _ in local + swarm),
        "rtt_ms_p50": stats["rtt_ms"]["p50"],
        "worker_ms_p50": stats["worker_ms_p50"],
        "overhead_ms_p50": overhead,
        "dispatches": stats["dispatches"],
        "failed_dispatches": stats["failed_dispatches"],
        "bytes_per_token_per_layer": stats["bytes_per_token_per_layer"],
        "load": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }
