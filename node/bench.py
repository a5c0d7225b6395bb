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

from .cli import emit_json, main

REFERENCE = dict(arch="qwen3moe", n_layer=1, n_embd=3072, n_head=24, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768)


@main.group("bench")
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


def wire_bytes(d: int, k: int) -> dict:
    """Payload bytes per token per layer: hidden out (+ k ids and weights), answers back."""
    route_meta = k * (2 + 4)  # int16 expert id + float32 weight per slot
    out = {}
    for codec in Codec:
        name = codec.name.lower()
        hidden = encoded_size(codec, 1, d)
        out[f"raw_{name}"] = {"out": hidden + route_meta, "back": k * hidden, "total": hidden + route_meta + k * hidden}
        out[f"partial_{name}"] = {"out": hidden + route_meta, "back": hidden, "total": 2 * hidden + route_meta}
    return out


@bench_group.command("experts")
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
        "bytes_per_token_per_layer": wire_bytes(cfg.n_embd, cfg.n_expert_used),
    }
    if write_md:
        _append_md(write_md, "moeswarm bench experts --json", result)
    if as_json:
        emit_json(result)
    else:
        for k, v in compute.items():
            click.echo(f"{k}: {v}")
        for k, v in result["bytes_per_token_per_layer"].items():
            click.echo(f"{k}: out {v['out']} B, back {v['back']} B, total {v['total']} B")


def _append_md(path: str, command: str, result: dict) -> None:
    import json

    with open(path, "a") as f:
        f.write(f"\n### `{command}` ({time.strftime('%Y-%m-%d')})\n\n```json\n{json.dumps(result, indent=1)}\n```\n")
