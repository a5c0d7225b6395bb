"""`moeswarm bench dispatch`'s measurement: loopback decode, remote (worker processes over QUIC) vs all-local."""

from __future__ import annotations

import asyncio
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np

from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import make_kernel
from experts.moe import Partition, grouped_moe
from experts.random_model import random_config, write_random_model
from node.backbone import onloop
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.backbone.spotcheck import DEFAULT_SPOT_CHECK
from node.bench.common import REFERENCE, message_bytes, overhead_ms_p50, udp_round_trip_floor
from node.bench.quic import process_cpu
from node.launcher import Cluster
from p2p.identity import Identity


def gap_breakdown(local_tps: float, remote_tps: float, stats: dict, n_layer: int, floor: dict, overhead_ms: float) -> dict:
    """Where the remote path's extra time per token goes: the round trip minus the worker's own time is transport
    (QUIC and framing; the forward runs on the loop's thread, so no thread hop); the worker's time minus the same compute
    done locally is its decode/encode/sign and queueing. Beside it: the overhead per dispatch that a ratio of 0.95
    allows, and the bare asyncio UDP round trip between two processes at the same sizes (`udp_round_trip_floor`),
    the part no Python transport removes."""
    per_token = 1e3 / remote_tps - 1e3 / local_tps
    rtt, worker = stats["rtt_ms"]["p50"], stats["worker_ms_p50"]
    return {
        "ms_per_token": round(per_token, 3),
        "ms_per_layer": round(per_token / n_layer, 3),
        "round_trip_ms_p50": rtt,
        "worker_ms_p50": worker,
        "transport_ms_p50": round(rtt - worker, 3),
        "overhead_ms_p50": overhead_ms,  # per dispatch: round trip minus the worker's time (`overhead_ms_p50`)
        "budget_ms_per_layer_at_0.95": round(1e3 / local_tps * (1 / 0.95 - 1) / n_layer, 3),
        **floor,
    }


def cpu_breakdown(cpu: dict, n_layer: int) -> dict:
    """CPU time per token (steadier than wall time on a loaded machine): the backbone process decoding locally and
    remotely (no ledger, no spot checks), the worker process per dispatch (from /proc, clock ticks), and what the
    remote path costs in CPU beyond the local one per dispatch (backbone + worker - local: transport, hops, codecs,
    receipts; positive is overhead)."""
    tokens = max(cpu["tokens"], 1)
    local, remote, worker = (1e3 * cpu[k] / tokens for k in ("local", "remote", "worker"))
    return {
        "backbone_ms_per_token_local": round(local, 3),
        "backbone_ms_per_token_remote": round(remote, 3),
        "worker_ms_per_dispatch": round(worker / n_layer, 3),
        "overhead_ms_per_dispatch": round((remote + worker - local) / n_layer, 3),
    }


def run(n_tokens: int, qtype: str, n_layer: int, n_expert: int, max_datagram: int, rounds: int) -> dict:
    """Rounds alternate local / remote without ledgers / remote with ledgers / remote with spot checks; medians of tokens/s.
    Every decode runs on the event loop's thread (``node.backbone.onloop``), as ``backbone generate`` does."""
    cfg = random_config(**{**REFERENCE, "n_layer": n_layer, "n_expert": n_expert})
    prompt = [72, 101, 108, 108, 111]
    with tempfile.TemporaryDirectory(prefix="moeswarm-bench-") as tmp:
        path = Path(tmp) / "reference.gguf"
        write_random_model(path, cfg, qtype=gguf.GGMLQuantizationType[qtype])
        model = GGUFModel(path)
        kernel = make_kernel("ggml", 1)  # local and backbone; each worker the same, one thread each
        bb = Backbone(model, kernel)
        store, _ = open_experts(model, kernel)
        whole = Partition(((0, cfg.n_expert),))
        local_hook = local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w))
        store.warm()

        def decode(hook) -> tuple[list[int], float]:
            t = time.perf_counter()
            toks = [tok for tok, _ in generate(bb, prompt, n_tokens, hook)]
            return toks, len(toks) / (time.perf_counter() - t)

        cpu = {"local": 0.0, "remote": 0.0, "worker": 0.0, "tokens": 0}

        async def timed(hook, kind: str, worker_pid: int | None = None) -> tuple[list[int], float]:
            """One decode on the loop's thread (as `backbone generate` runs it), its CPU seconds added to *kind*."""
            t, w = time.process_time(), process_cpu(worker_pid) if worker_pid else 0.0
            out = await onloop.run_on_loop(decode, hook)
            cpu[kind] += time.process_time() - t
            if worker_pid:
                cpu["worker"] += process_cpu(worker_pid) - w
                cpu["tokens"] += len(out[0])
            return out

        with Cluster(Path(tmp) / "nodes") as cluster:
            # Two one-worker swarms, so each backbone session reaches exactly its worker: one pair records
            # receipts in ledgers on both sides, the other runs with no ledger.
            boots = [cluster.start(f"bootstrap-{name}", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0] for name in ("plain", "ledger")]
            worker_args = ("worker", "--model", str(path), "--max-datagram", str(max_datagram), "--kernel", "ggml", "--threads", "1")
            plain = cluster.start("worker-no-ledger", *worker_args, "--bootstrap", boots[0], "--no-ledger")
            plain.wait_ready(600)
            assert plain.proc is not None
            plain_pid = plain.proc.pid
            cluster.start("worker-ledger", *worker_args, "--bootstrap", boots[1]).wait_ready(600)

            async def interleaved():
                """Rounds alternate local / remote without ledgers / remote with ledgers on both sides / remote with the
                default spot checks (re-computed locally; the others check nothing), so drifting machine load hits all alike."""
                ledger_path = Path(tmp) / "backbone-ledger.sqlite"
                unchecked = BackboneOptions(max_datagram=max_datagram, spot_check=0.0)
                async with (
                    backbone_session(Identity.generate(), model, [boots[0]], kernel, unchecked) as bare,
                    backbone_session(Identity.generate(), model, [boots[1]], kernel, replace(unchecked, ledger_path=ledger_path)) as booked,
                    backbone_session(Identity.generate(), model, [boots[0]], kernel, replace(unchecked, spot_check=DEFAULT_SPOT_CHECK)) as checked,
                ):
                    for moe in (bare, booked, checked):
                        await wait_for_hosts(moe, model.moe_layers, 1, 60)
                        await onloop.run_on_loop(decode, moe.hook)  # warm-up: connections, RTT, caches
                    bare.stats.records.clear()
                    bare.stats.tokens_forwarded = 0
                    local, remote, remote_ledger, remote_checked = [], [], [], []
                    for _ in range(rounds):
                        local.append(await timed(local_hook, "local"))
                        remote.append(await timed(bare.hook, "remote", plain_pid))
                        remote_ledger.append(await onloop.run_on_loop(decode, booked.hook))
                        remote_checked.append(await onloop.run_on_loop(decode, checked.hook))
                    return local, remote, remote_ledger, remote_checked, bare.stats.summary(), checked.checker.summary(), overhead_ms_p50(bare.stats.records)

            local, remote, remote_ledger, remote_checked, stats, checks, overhead_ms = asyncio.run(interleaved())
        sizes = message_bytes(cfg.n_embd, cfg.n_expert_used)["partial_f32"]
        floor = udp_round_trip_floor(int(sizes["out"]), int(sizes["back"]))
        local_tps = float(np.median([tps for _, tps in local]))
        remote_tps = float(np.median([tps for _, tps in remote]))
        ledger_tps = float(np.median([tps for _, tps in remote_ledger]))
        checked_tps = float(np.median([tps for _, tps in remote_checked]))
    result = {
        "config": {**REFERENCE, "n_layer": n_layer, "n_expert": n_expert, "qtype": qtype, "max_datagram": max_datagram},
        "machine": f"{platform.machine()}, numpy {np.__version__}, OPENBLAS_NUM_THREADS=1",
        "kernel": f"{kernel.identity}, 1 thread per process",
        "bytes_per_token_per_layer": message_bytes(cfg.n_embd, cfg.n_expert_used),
        "measured_f32_bytes_per_token_per_layer": stats["bytes_per_token_per_layer"],
        "throughput": {"local_tokens_s": round(local_tps, 3), "remote_tokens_s": round(remote_tps, 3), "ratio": round(remote_tps / local_tps, 3)},
        "ledger": {"remote_tokens_s_without": round(remote_tps, 3), "remote_tokens_s_with": round(ledger_tps, 3), "cost_pct": round(100 * (1 - ledger_tps / remote_tps), 2)},
        "spot_check": {"rate": DEFAULT_SPOT_CHECK, "remote_tokens_s_without": round(remote_tps, 3), "remote_tokens_s_with": round(checked_tps, 3),
                       "cost_pct": round(100 * (1 - checked_tps / remote_tps), 2), "checked": checks["checked"], "caught": checks["caught"]},
        "identical": all(t == local[0][0] for t, _ in local + remote + remote_ledger + remote_checked),
        "rtt_ms": stats["rtt_ms"],
        "gap": gap_breakdown(local_tps, remote_tps, stats, n_layer, floor, overhead_ms),
        "cpu": cpu_breakdown(cpu, n_layer),
    }
    return result
