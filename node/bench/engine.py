"""`moeswarm bench engine`' measurement: moeswarm's local engine vs llama.cpp on the same GGUF file.

Both engines run in this process, on one random Qwen3-30B-A3B-shaped model (hidden 2048, 32/4 heads
of 128, 128 experts, top-8, FFN 768; Q4_K) in alternating rounds, so drift and noisy neighbours hit
them alike:

* moeswarm: ``Backbone`` with the ggml kernel on the packed bytes for the dense part, and
  ``PackedExperts.partial_sum`` (same kernel) as the local MoE hook;
* llama.cpp: llama-cpp-python with an F32 KV cache (``type_k=type_v=0``, as our forward keeps).

Each at 1 and 2 threads: greedy decode tokens/s (a short prompt prefilled untimed, then one token
per step, each engine following its own argmax) and the tokens/s of one prefill of ``n_prefill``
tokens. Peak resident memory of moeswarm is measured in a fresh child process (``VmHWM`` after a
prefill, a few decode steps and one token through every expert), next to the file's size; and where a
1-thread decode step of moeswarm goes (kernel calls vs the rest). Returns a dict; prints nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import gguf
import numpy as np

from experts.forward import Backbone, KVCache, MoeFfn, local_moe
from experts.gguf_model import GGUFModel
from experts.kernels import ExpertBias, Kernel, QuantWeight, make_kernel
from experts.moe import SWIGLU, Glu, Progress
from experts.packed_experts import PackedExperts
from experts.random_model import random_config, write_random_model
from experts.reference import llamacpp

# Qwen3-30B-A3B's shape, but few layers (the benchmark model).
QWEN3_30B_A3B = dict(arch="qwen3moe", n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768)
THREADS = (1, 2)
PROMPT = 8  # tokens prefilled, untimed, before each decode run


def packed_moe(experts: PackedExperts) -> MoeFfn:
    """The all-local MoE hook on packed experts: every slot of every token, summed in slot order."""

    def moe(layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        return experts.partial_sum(layer, x, ids, w, np.ones(ids.shape, dtype=bool))[0]

    return local_moe(moe)


class TimedKernel:
    """A kernel that adds up the wall time of its calls, to split a decode step into kernel time and the rest."""

    dequantizes: ClassVar[bool] = False  # it times the ggml kernel (``run``), which computes on the quantized bytes

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.identity = kernel.identity
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def matmul(self, x: np.ndarray, weight: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.kernel.matmul(x, weight, qtype, shape)
        finally:
            self.seconds["matmul"] += time.perf_counter() - t0

    def expert_ffn(self, x: np.ndarray, experts: np.ndarray, gate: QuantWeight, up: QuantWeight, down: QuantWeight, act: Glu = SWIGLU, bias: ExpertBias | None = None) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.kernel.expert_ffn(x, experts, gate, up, down, act, bias)
        finally:
            self.seconds["expert_ffn"] += time.perf_counter() - t0


class Moeswarm:
    """moeswarm's local engine on *model* with the ggml kernel (self-tested) at *threads*, or with *kernel*."""

    def __init__(self, model: GGUFModel, threads: int, kernel: Kernel | None = None) -> None:
        kernel = kernel or make_kernel("ggml", threads)
        self.kernel = kernel
        self.backbone = Backbone(model, kernel=kernel)
        self.experts = PackedExperts(model, kernel)
        self.moe = packed_moe(self.experts)
        self.cache = KVCache()

    def reset(self) -> None:
        self.cache = KVCache()

    def eval(self, tokens: list[int]) -> int:
        """Append *tokens*; the greedy next token."""
        return int(self.backbone.forward(tokens, self.cache, self.moe)[-1].argmax())


class LlamaCpp:
    """llama.cpp on *path* at *threads* (decode and prompt), F32 KV cache."""

    def __init__(self, path: Path, threads: int, n_ctx: int, n_batch: int) -> None:
        self.llm = llamacpp(path, n_ctx=n_ctx, n_batch=n_batch, threads=threads, threads_batch=threads)

    def reset(self) -> None:
        self.llm.reset()

    def eval(self, tokens: list[int]) -> int:
        self.llm.eval(tokens)
        return int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))

    def close(self) -> None:
        self.llm.close()


Engine = Moeswarm | LlamaCpp


def decode_seconds(engine: Engine, prompt: list[int], n_tokens: int) -> float:
    """Seconds for *n_tokens* greedy decode steps after an untimed prefill of *prompt*."""
    engine.reset()
    tok = engine.eval(prompt)
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        tok = engine.eval([tok])
    return time.perf_counter() - t0


def prefill_seconds(engine: Engine, tokens: list[int]) -> float:
    """Seconds to run *tokens* through a fresh cache in one call."""
    engine.reset()
    t0 = time.perf_counter()
    engine.eval(tokens)
    return time.perf_counter() - t0


def decode_breakdown(model: GGUFModel, prompt: list[int], n_tokens: int) -> dict[str, float]:
    """Milliseconds per 1-thread decode step: in the kernel's expert FFN calls (routed experts, and a shared
    expert if the arch has one), in its matmuls (attention q/k/v/o, router, output head) and everything else
    (numpy attention, norms, routing, sums, Python). Measured after the timed rounds, not in them."""
    kernel = TimedKernel(make_kernel("ggml", 1, check=False))
    engine = Moeswarm(model, 1, kernel)
    engine.reset()
    tok = engine.eval(prompt)
    kernel.seconds.clear()  # count the decode steps only
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        tok = engine.eval([tok])
    seconds = time.perf_counter() - t0
    ms = lambda s: round(s / n_tokens * 1e3, 3)  # noqa: E731
    return {
        "step_ms": ms(seconds),
        "kernel_expert_ffn_ms": ms(kernel.seconds["expert_ffn"]),
        "kernel_matmul_ms": ms(kernel.seconds["matmul"]),
        "other_ms": ms(seconds - kernel.seconds["expert_ffn"] - kernel.seconds["matmul"]),
    }


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def rss_child() -> None:
    """Child-process entry: argv = path, n_prefill, n_tokens; prints the resident bytes before and at peak as JSON."""
    path, n_prefill, n_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    base = _status()
    engine = Moeswarm(GGUFModel(path), threads=1)
    rng = np.random.default_rng(1)
    model = engine.backbone.model
    prefill_seconds(engine, rng.integers(0, 256, n_prefill).tolist())
    decode_seconds(engine, rng.integers(0, 256, PROMPT).tolist(), n_tokens)
    # A random model's router sends every token to the same few experts (its K-quant blocks are not
    # centred, so hidden states share a large offset); serve every expert once so the peak counts
    # every weight read, as a long run on a real model would.
    x = np.ones((1, model.cfg.n_embd), dtype=np.float32)
    for layer in model.moe_layers:
        for e in range(model.experts.start, model.experts.stop):
            engine.experts.ffn(layer, x, np.array([e]))
    print(json.dumps({"baseline": base["VmRSS"], "peak": _status()["VmHWM"]}))


def resident_peak(path: Path, n_prefill: int, n_tokens: int) -> dict[str, int]:
    """Peak resident bytes of a fresh process that opens *path* and runs moeswarm's engine on it."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1")}
    code = "from node.bench.engine import rss_child; rss_child()"
    done = subprocess.run([sys.executable, "-c", code, str(path), str(n_prefill), str(n_tokens)], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # the last line: loading may log before it


def _compare(timings: dict[tuple[str, str], list[float]], kind: str, n_tokens: int) -> dict:
    """Median tokens/s of every engine for *kind* ("decode" or "prefill"), and moeswarm's ratio at each thread count."""
    tps = {name: round(n_tokens / statistics.median(t), 2) for (k, name), t in timings.items() if k == kind}
    out: dict = {"moeswarm_tps": tps["moeswarm_1t"], "moeswarm_tps_2t": tps["moeswarm_2t"]}
    for t in THREADS:
        out[f"llamacpp_tps_{t}t"] = tps[f"llamacpp_{t}t"]
        out[f"ratio_{t}t"] = round(tps[f"moeswarm_{t}t"] / tps[f"llamacpp_{t}t"], 4)
    return out


def run(
    n_layer: int = 4,
    n_tokens: int = 32,
    n_prefill: int = 128,
    rounds: int = 3,
    qtype: str = "Q4_K",
    shape: dict | None = None,
    model_path: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Decode and prefill tokens/s of both engines at 1 and 2 threads, and moeswarm's peak RSS; see the module docstring
    (*progress* hears after each measured round)."""
    shape = {**QWEN3_30B_A3B, **(shape or {})}
    with tempfile.TemporaryDirectory() as tmp:
        if model_path is None:
            path = Path(tmp) / "engine.gguf"
            write_random_model(path, random_config(n_layer=n_layer, **shape), qtype=gguf.GGMLQuantizationType[qtype])
        else:
            path = Path(model_path)
        model = GGUFModel(path)
        n_ctx = max(n_prefill, PROMPT + n_tokens + 1) + 16
        ours = {f"moeswarm_{t}t": Moeswarm(model, t) for t in THREADS}
        theirs = {f"llamacpp_{t}t": LlamaCpp(path, t, n_ctx, max(n_prefill, PROMPT)) for t in THREADS}
        engines: dict[str, Engine] = {**ours, **theirs}
        rng = np.random.default_rng(0)
        timings: dict[tuple[str, str], list[float]] = {}
        try:
            for engine in engines.values():  # warm-up: pages of the file, thread pools, graph set-up
                decode_seconds(engine, rng.integers(0, 256, PROMPT).tolist(), 2)
            for r in range(rounds):
                prompt = rng.integers(0, 256, PROMPT).tolist()
                batch = rng.integers(0, 256, n_prefill).tolist()
                order = list(engines.items())
                for name, engine in order[::-1] if r % 2 else order:
                    timings.setdefault(("decode", name), []).append(decode_seconds(engine, prompt, n_tokens))
                    timings.setdefault(("prefill", name), []).append(prefill_seconds(engine, batch))
                if progress:
                    progress(r + 1, rounds)
        finally:
            for llm in theirs.values():
                llm.close()
        breakdown = decode_breakdown(model, rng.integers(0, 256, PROMPT).tolist(), n_tokens)
        rss = resident_peak(path, n_prefill, min(n_tokens, 8))
        file_bytes = path.stat().st_size
        cfg = model.cfg
    return {
        "decode": _compare(timings, "decode", n_tokens),
        "prefill": _compare(timings, "prefill", n_prefill),
        "moeswarm_decode_step": breakdown,
        "rss": {"moeswarm_bytes": rss["peak"], "baseline_bytes": rss["baseline"], "file_bytes": file_bytes, "ratio": round(rss["peak"] / file_bytes, 3)},
        "config": {
            **asdict(cfg),
            "qtype": model.qtype("blk.0.ffn_down_exps.weight").name,
            "decode_tokens": n_tokens,
            "prefill_tokens": n_prefill,
            "rounds": rounds,
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        },
        "kernel": str(ours["moeswarm_1t"].kernel.identity),
    }
