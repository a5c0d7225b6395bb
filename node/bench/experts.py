"""`moeswarm bench experts`' measurement: expert compute per token per layer at the reference config.

Two parts, both at the reference config: today's ``ExpertStore`` paths (F32 cached vs dequantized on
the fly, through a real GGUF file) and the kernels on the packed bytes next to the memory-bandwidth
floor the benchmark measures itself (``experts.bench_kernels``).
"""

from __future__ import annotations

import platform
import tempfile
from pathlib import Path

import gguf
import numpy as np

from experts.bench_kernels import bench_kernels
from experts.gguf_model import ExpertRange, GGUFModel
from experts.moe import partial_sum
from experts.random_model import random_config, write_random_model
from experts.slices import ExpertStore
from node.bench.common import REFERENCE, median_time, message_bytes


def run(repeat: int, qtype: str, threads: int = 1) -> dict:
    """Cached vs on-the-fly dequantized experts, the kernels vs the bandwidth floor, 1 and 8 tokens, and the exact wire bytes."""
    cfg = random_config(**REFERENCE)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference.gguf"
        write_random_model(path, cfg, qtype=gguf.GGMLQuantizationType[qtype])
        model = GGUFModel(path)
        pool = ExpertRange(0, 16)  # tokens route among 16 experts so the cached store fits in RAM
        stores = {"cached": ExpertStore(model, experts=pool), "on_the_fly": ExpertStore(model, experts=pool, cache=False)}
        compute = {}
        for n in (1, 8):
            x = rng.standard_normal((n, cfg.n_embd)).astype(np.float32)
            ids = np.stack([rng.choice(16, cfg.n_expert_used, replace=False) for _ in range(n)]).astype(np.int32)
            w = np.full(ids.shape, 1.0 / cfg.n_expert_used, dtype=np.float32)
            held = np.ones(ids.shape, dtype=bool)
            for mode, store in stores.items():
                t = median_time(lambda: partial_sum(store, 0, x, ids, w, held), repeat)
                compute[f"{mode}_{n}tok_ms_per_token"] = round(t / n * 1e3, 3)
    # The reference kernel and bench_kernels' cached path are the stores' on-the-fly and cached paths above: not timed twice.
    kernels = bench_kernels(
        hidden=cfg.n_embd, n_expert=cfg.n_expert, top_k=cfg.n_expert_used, ffn=cfg.n_ff_exp,
        qtype=gguf.GGMLQuantizationType[qtype], threads=threads, rounds=repeat, reference_rounds=0,
    )  # fmt: skip
    compute.update({k: v for k, v in kernels["expert_compute"].items() if v is not None and k != "reference_kernel"})
    result = {
        "config": {**REFERENCE, "qtype": qtype, "threads": threads},
        "machine": f"{platform.machine()}, numpy {np.__version__}",
        "expert_compute": compute,
        "bytes_per_token_per_layer": message_bytes(cfg.n_embd, cfg.n_expert_used),
    }
    return result
