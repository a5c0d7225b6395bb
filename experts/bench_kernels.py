"""Expert compute per token per layer, kernel by kernel, next to the machine's memory-bandwidth floor.

One token's MoE layer must read the packed bytes of its top-k experts' gate, up and down
matrices at least once, so ``bytes / read bandwidth`` is a floor no kernel can beat on one
core. The benchmark measures that bandwidth itself (summing a large array, median of rounds)
and times, in alternating rounds so drift and noisy neighbours hit every kernel alike:

* ``kernel``: the fast kernel (``experts.kernels.GgmlKernel``) on the packed bytes;
* ``reference``: the portable numpy kernel on the same bytes (dequantizes per call);
* ``numpy_cached``: today's cached worker path, F32 weights dequantized beforehand (only the
  compute is timed; it needs ~7x the memory).

Experts are drawn afresh every round so their bytes come from memory, not from cache. Pure
function: returns a dict, prints nothing; the CLI (``moeswarm bench experts``) formats it.
"""

from __future__ import annotations

import statistics
import time

import gguf
import numpy as np

from .gguf_model import dequantize_bytes
from .kernels import GgmlKernel, QuantWeight, ReferenceKernel
from .kernels.samples import random_expert_stack
from .moe import expert_ffn

Q = gguf.GGMLQuantizationType


def read_bandwidth_gbs(n_bytes: int = 256 << 20, rounds: int = 7) -> float:
    """One core's read bandwidth: bytes of a large float32 array summed per second (median of rounds)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    a.sum()  # fault the pages in
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return n_bytes / statistics.median(times) / 1e9


def _pairs(rng: np.random.Generator, n_tokens: int, n_expert: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(token row, expert) for every token's top-k distinct experts, token by token."""
    experts = np.concatenate([rng.choice(n_expert, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    return np.repeat(np.arange(n_tokens), top_k), experts


def bench_kernels(
    *,
    hidden: int = 3072,
    n_expert: int = 128,
    top_k: int = 8,
    ffn: int = 768,
    qtype: gguf.GGMLQuantizationType = Q.Q4_K,
    threads: int = 1,
    rounds: int = 5,
    reference_rounds: int = 2,
    bandwidth_bytes: int = 256 << 20,
    seed: int = 0,
) -> dict:
    """Time one MoE layer's expert FFNs for 1 and 8 tokens with each kernel; see the module docstring."""
    rng = np.random.default_rng(seed)
    gate = QuantWeight(random_expert_stack(qtype, n_expert, ffn, hidden, rng), qtype, (n_expert, ffn, hidden))
    up = QuantWeight(random_expert_stack(qtype, n_expert, ffn, hidden, rng), qtype, (n_expert, ffn, hidden))
    down = QuantWeight(random_expert_stack(qtype, n_expert, hidden, ffn, rng), qtype, (n_expert, hidden, ffn))
    per_expert = gate.data.shape[1] + up.data.shape[1] + down.data.shape[1]
    fast, ref = GgmlKernel(threads=threads), ReferenceKernel()

    def cached(x, experts):  # today's cached path: F32 experts prepared outside the timed region
        mats = {int(e): tuple(ref_mat(w, int(e)) for w in (gate, up, down)) for e in np.unique(experts)}

        def run():
            out = np.empty_like(x)
            for e, (g, u, d) in mats.items():
                rows = np.nonzero(experts == e)[0]
                out[rows] = expert_ffn(x[rows], g, u, d)
            return out

        return run

    def ref_mat(w: QuantWeight, e: int) -> np.ndarray:
        return dequantize_bytes(w.data[e], w.qtype, tuple(w.shape[1:]))

    times: dict[str, list[float]] = {}
    fast.expert_ffn(np.zeros((1, hidden), np.float32), np.zeros(1, np.int32), gate, up, down)  # warm up (thread start-up, page faults of one expert)
    for r in range(rounds):
        for n_tokens in (1, 8):
            rows, experts = _pairs(rng, n_tokens, n_expert, top_k)
            x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)[rows]
            runs = [("kernel", lambda: fast.expert_ffn(x, experts, gate, up, down))]
            if r < reference_rounds:
                runs.append(("reference", lambda: ref.expert_ffn(x, experts, gate, up, down)))
                runs.append(("numpy_cached", cached(x, experts)))
            if r % 2:
                runs.reverse()
            for name, fn in runs:
                t0 = time.perf_counter()
                fn()
                times.setdefault(f"{name}_{n_tokens}", []).append(time.perf_counter() - t0)
    bandwidth = read_bandwidth_gbs(bandwidth_bytes)
    floor_1tok = top_k * per_expert / (bandwidth * 1e9)

    def ms(name: str, n_tokens: int) -> float | None:
        if f"{name}_{n_tokens}" not in times:
            return None
        return round(statistics.median(times[f"{name}_{n_tokens}"]) * 1e3 / n_tokens, 4)

    result = {
        "kernel_1tok_ms": ms("kernel", 1),
        "kernel_8tok_ms_per_token": ms("kernel", 8),
        "floor_1tok_ms": round(floor_1tok * 1e3, 4),
        "bandwidth_gbs": round(bandwidth, 2),
        "kernel_vs_floor_1tok": round(ms("kernel", 1) / (floor_1tok * 1e3), 3),
        "reference_1tok_ms": ms("reference", 1),
        "reference_8tok_ms_per_token": ms("reference", 8),
        "numpy_cached_1tok_ms": ms("numpy_cached", 1),
        "numpy_cached_8tok_ms_per_token": ms("numpy_cached", 8),
        "bytes_1tok": top_k * per_expert,
        "kernel": str(fast.identity),
        "reference_kernel": str(ref.identity),
    }
    return {
        "expert_compute": result,
        "config": {"hidden": hidden, "n_expert": n_expert, "top_k": top_k, "ffn": ffn, "qtype": qtype.name, "threads": threads, "rounds": rounds},
    }


_RSS_CHILD = r"""
import json, sys
import numpy as np
from experts.gguf_model import GGUFModel

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

path, mode, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = GGUFModel(path)
cfg = model.cfg
if mode == "packed":
    from experts.kernels import GgmlKernel
    from experts.packed_experts import PackedExperts
    source = PackedExperts(model, GgmlKernel(threads=threads))
else:
    from experts.slices import ExpertStore
    source = ExpertStore(model)
x = np.ones((1, cfg.n_embd), dtype=np.float32)
base = status()
for layer in model.moe_layers:  # every expert serves one token: every hosted weight is touched once
    for e in range(model.experts.start, model.experts.stop):
        if mode == "packed":
            source.ffn(layer, x, np.array([e]))
        else:
            from experts.moe import expert_ffn
            expert_ffn(x, *source.weights(layer, e))
print(json.dumps({"baseline": base, "served": status()}))
"""


def resident_memory(path: str, mode: str = "packed", threads: int = 1) -> dict:
    """Resident bytes of a fresh process that opens the GGUF at *path* and serves every expert once.

    *mode* "packed": ``PackedExperts`` through the ggml kernel (weights stay in the memory map);
    "cached": today's ``ExpertStore`` in cached mode (every expert dequantized to float32 and kept).
    Returns the baseline (model opened, no expert used) and the served figures (VmRSS / RssAnon /
    RssFile), measured by the child from /proc/self/status.
    """
    import json
    import os
    import subprocess
    import sys

    if mode not in ("packed", "cached"):
        raise ValueError(f"mode must be 'packed' or 'cached', not {mode!r}")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), mode, str(threads)], capture_output=True, text=True, env=env, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])  # the last line: the store may log before it
    got["file_bytes"] = os.path.getsize(path)
    got["served_minus_baseline"] = got["served"]["VmRSS"] - got["baseline"]["VmRSS"]
    return got
