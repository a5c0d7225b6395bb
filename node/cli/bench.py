"""`moeswarm bench ...`: measurements that go into BENCHMARKS.md (never assertions in tests)."""

from __future__ import annotations

import platform
import tempfile
import time
from pathlib import Path

import click
import gguf
import numpy as np

from experts.codecs import Codec, encoded_size
from experts.gguf_model import ExpertRange, GGUFModel
from experts.moe import partial_sum
from experts.random_model import random_config, write_random_model
from experts.slices import ExpertStore

from node.cli.root import LazyGroup, emit_json

REFERENCE = dict(arch="qwen3moe", n_layer=1, n_embd=3072, n_head=24, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768)


@click.group(
    "bench",
    cls=LazyGroup,
    lazy_subcommands={
        "dispatch": "node.cli.bench:bench_dispatch",
        "experts": "node.cli.bench:bench_experts",
        "paths": "node.cli.bench_paths:bench_paths",
        "wan": "node.cli.bench_wan:bench_wan",
    },
)
def bench_group() -> None:
    """Benchmarks; results go to BENCHMARKS.md with the command that produced them."""


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


@click.command("experts")
@click.option("--json", "as_json", is_flag=True)
@click.option("--repeat", default=5, show_default=True)
@click.option("--qtype", default="Q4_K", show_default=True)
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_experts(as_json: bool, repeat: int, qtype: str, write_md: str | None) -> None:
    """Expert compute per token per layer (reference config), cached vs on-the-fly, and wire bytes."""
    cfg = random_config(**REFERENCE)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference.gguf"
        write_random_model(path, cfg, qtype=gguf.GGMLQuantizationType[qtype])
        model = GGUFModel(path)
        pool = ExpertRange(0, 16)  # tokens route among 16 experts so the cached store fits in RAM
        stores = {"cached": ExpertStore(model, experts=pool), "on_the_fly": ExpertStore(model, experts=pool, memory_budget=0)}
        compute = {}
        for n in (1, 8):
            x = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
            ids = np.stack([rng.choice(16, cfg.n_expert_used, replace=False) for _ in range(n)]).astype(np.int32)
            w = np.full(ids.shape, 1.0 / cfg.n_expert_used, dtype=np.float32)
            held = np.ones(ids.shape, dtype=bool)
            for mode, store in stores.items():
                t = _time(lambda: partial_sum(store, 0, x, ids, w, held), repeat)
                compute[f"{mode}_{n}tok_ms_per_token"] = round(t / n * 1e3, 3)
    result = {
        "config": {**REFERENCE, "qtype": qtype},
        "machine": f"{platform.machine()}, numpy {np.__version__}",
        "expert_compute": compute,
        "bytes_per_token_per_layer": message_bytes(cfg.n_embd, cfg.n_expert_used),
    }
    lines = [f"{k}: {v}" for k, v in compute.items()]
    lines += [f"{k}: out {v['out']} B, back {v['back']} B, total {v['total']} B" for k, v in result["bytes_per_token_per_layer"].items()]
    publish(result, "moeswarm bench experts --json", write_md=write_md, as_json=as_json, lines=lines)


def publish(result: dict, command: str, *, write_md: str | None, as_json: bool, lines: list[str]) -> None:
    """Every benchmark's ending: append `result` under the `command` that produced it to `write_md` (if given), then
    print it as JSON or as the human summary `lines`."""
    if write_md:
        import json

        with open(write_md, "a") as f:
            f.write(f"\n### `{command}` ({time.strftime('%Y-%m-%d')})\n\n```json\n{json.dumps(result, indent=1)}\n```\n")
    if as_json:
        emit_json(result)
    else:
        for line in lines:
            click.echo(line)


def message_bytes(d: int, k: int, n_tokens: int = 1) -> dict:
    """Exact dispatch message sizes per token per layer, for one worker holding all k experts of a token.

    ``partial_*``: what the protocol sends (one weighted sum per token back). ``raw_*``: the
    baseline of returning every expert's output (k vectors per token), sized with the same framing.
    """
    from p2p import wire

    out = {}
    ids = tuple(range(k)) * n_tokens
    weights = (1.0 / k,) * (k * n_tokens)
    for codec in Codec:
        hidden = b"\0" * encoded_size(codec, n_tokens, d)
        req = wire.DispatchRequest(b"\1" * 16, b"\2" * 16, 0, codec, n_tokens, k, ids, weights, hidden).encode()
        for kind, rows in (("partial", n_tokens), ("raw", n_tokens * k)):
            reply = wire.DispatchReply(b"\1" * 16, codec, n_tokens, b"\0" * encoded_size(codec, rows, d), 0, b"\0" * 72).encode()
            out[f"{kind}_{codec.name.lower()}"] = {"out": len(req) / n_tokens, "back": len(reply) / n_tokens, "total": (len(req) + len(reply)) / n_tokens}
    return out


@click.command("dispatch")
@click.option("--json", "as_json", is_flag=True)
@click.option("--tokens", "n_tokens", default=16, show_default=True, help="Decode steps timed per path.")
@click.option("--qtype", default="Q4_K", show_default=True)
@click.option("--layers", "n_layer", default=1, show_default=True)
@click.option("--experts", "n_expert", default=REFERENCE["n_expert"], show_default=True, help="Fewer for a quick run.")
@click.option("--max-datagram", default=16384, show_default=True, help="QUIC datagram size on both ends (loopback takes 16384).")
@click.option("--rounds", default=3, show_default=True, help="Alternating local/remote rounds; medians are reported.")
@click.option("--write", "write_md", type=click.Path(dir_okay=False), default=None, help="Append the results to this Markdown file.")
def bench_dispatch(as_json: bool, n_tokens: int, qtype: str, n_layer: int, n_expert: int, max_datagram: int, rounds: int, write_md: str | None) -> None:
    """Loopback decode throughput, remote (1 worker process over QUIC) vs all-local, and exact message bytes."""
    import asyncio

    from experts.forward import Backbone, local_moe
    from experts.generate import generate
    from experts.moe import Partition, grouped_moe
    from p2p.identity import Identity

    from node.launcher import Cluster
    from node.backbone.session import backbone_session, wait_for_hosts

    cfg = random_config(**{**REFERENCE, "n_layer": n_layer, "n_expert": n_expert})
    prompt = [72, 101, 108, 108, 111]
    with tempfile.TemporaryDirectory(prefix="moeswarm-bench-") as tmp:
        path = Path(tmp) / "reference.gguf"
        write_random_model(path, cfg, qtype=gguf.GGMLQuantizationType[qtype])
        model = GGUFModel(path)
        bb = Backbone(model)
        store = ExpertStore(model)
        whole = Partition(((0, cfg.n_expert),))
        local_hook = local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w))
        store.warm()

        def decode(hook) -> tuple[list[int], float]:
            t = time.perf_counter()
            toks = [tok for tok, _ in generate(bb, prompt, n_tokens, hook)]
            return toks, len(toks) / (time.perf_counter() - t)

        with Cluster(Path(tmp) / "nodes") as cluster:
            # Two one-worker swarms, so each backbone session reaches exactly its worker: one pair records
            # receipts in ledgers on both sides, the other runs with no ledger.
            boots = [cluster.start(f"bootstrap-{name}", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0] for name in ("plain", "ledger")]
            worker_args = ("worker", "--model", str(path), "--max-datagram", str(max_datagram))
            cluster.start("worker-no-ledger", *worker_args, "--bootstrap", boots[0], "--no-ledger").wait_ready(600)
            cluster.start("worker-ledger", *worker_args, "--bootstrap", boots[1]).wait_ready(600)

            async def interleaved():
                """Rounds alternate local / remote without ledgers / remote with ledgers on both sides,
                so drifting machine load hits all three alike."""
                ledger_path = Path(tmp) / "backbone-ledger.sqlite"
                session = dict(max_datagram=max_datagram)
                async with backbone_session(Identity.generate(), model, [boots[0]], **session) as bare, backbone_session(Identity.generate(), model, [boots[1]], ledger_path=ledger_path, **session) as booked:
                    for moe in (bare, booked):
                        await wait_for_hosts(moe, model.layers, 1, 60)
                        await asyncio.to_thread(decode, moe.hook)  # warm-up: connections, RTT, caches
                    bare.stats.records.clear()
                    bare.stats.tokens_forwarded = 0
                    local, remote, remote_ledger = [], [], []
                    for _ in range(rounds):
                        local.append(await asyncio.to_thread(decode, local_hook))
                        remote.append(await asyncio.to_thread(decode, bare.hook))
                        remote_ledger.append(await asyncio.to_thread(decode, booked.hook))
                    return local, remote, remote_ledger, bare.stats.summary()

            local, remote, remote_ledger, stats = asyncio.run(interleaved())
        local_tps = float(np.median([tps for _, tps in local]))
        remote_tps = float(np.median([tps for _, tps in remote]))
        ledger_tps = float(np.median([tps for _, tps in remote_ledger]))
    result = {
        "config": {**REFERENCE, "n_layer": n_layer, "n_expert": n_expert, "qtype": qtype, "max_datagram": max_datagram},
        "machine": f"{platform.machine()}, numpy {np.__version__}, OPENBLAS_NUM_THREADS=1",
        "bytes_per_token_per_layer": message_bytes(cfg.n_embd, cfg.n_expert_used),
        "measured_f32_bytes_per_token_per_layer": stats["bytes_per_token_per_layer"],
        "throughput": {"local_tokens_s": round(local_tps, 3), "remote_tokens_s": round(remote_tps, 3), "ratio": round(remote_tps / local_tps, 3)},
        "ledger": {"remote_tokens_s_without": round(remote_tps, 3), "remote_tokens_s_with": round(ledger_tps, 3), "cost_pct": round(100 * (1 - ledger_tps / remote_tps), 2)},
        "identical": all(t == local[0][0] for t, _ in local + remote + remote_ledger),
        "rtt_ms": stats["rtt_ms"],
    }
    t, lg = result["throughput"], result["ledger"]
    lines = [f"{k}: out {v['out']:.0f} B, back {v['back']:.0f} B, total {v['total']:.0f} B" for k, v in result["bytes_per_token_per_layer"].items()]
    lines += [f"decode: local {t['local_tokens_s']} tokens/s, remote {t['remote_tokens_s']} tokens/s, ratio {t['ratio']}; identical {result['identical']}",
              f"ledgers: remote {lg['remote_tokens_s_without']} tokens/s without, {lg['remote_tokens_s_with']} with ({lg['cost_pct']}% cost)"]  # fmt: skip
    publish(result, "moeswarm bench dispatch --json", write_md=write_md, as_json=as_json, lines=lines)
