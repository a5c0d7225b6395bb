"""The startup self-test: prove on *this* machine, with *this* build, that a kernel is batch invariant.

Batch invariance is a property of the library build and the kernel path it picks on the CPU at
hand (measured: the libggml inside llama-cpp-python switches Q4_K to a repacked kernel once >= 8
rows share a call, and its rows' bits change), so it cannot be assumed from the version alone.
Before serving, a worker runs ``self_test``: for every quant type, a row's bits must be the same

* whether 1, 2, ..., 17 rows share the call (prefixes of one batch), and
* whichever other random rows share it, in whichever order (mixed batches),

for the plain matmul and for the expert FFN (rows going to different experts). Otherwise it
raises ``KernelError`` naming the kernel, the quant type and the first differing case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import gguf
import numpy as np

from ..arch import Activation
from ..errors import KernelError
from ..moe import OAI_LIMIT, SWIGLU, Glu, Progress
from .base import QTYPES, ExpertBias, Kernel, QuantWeight
from .samples import random_expert_stack, random_weight

MAX_ROWS = 17  # covers the 8-row tiles and SIMD widths of every kernel we know, plus a ragged remainder
N_MIXED = 4


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _check(kernel: Kernel, what: str, call: Callable[[np.ndarray], np.ndarray], x: np.ndarray, rng: np.random.Generator) -> None:
    """call(index array into x) -> the rows' outputs; each row must equal its row of the full batch."""
    full = call(np.arange(len(x)))

    def fail(case: str) -> None:
        raise KernelError(
            f"kernel {kernel.identity} is not batch invariant on this machine ({what}: {case}); "
            "it must not serve: its results would change with the batch a row lands in; run with --kernel reference"
        )

    for m in range(1, len(x) + 1):
        if not _same_bits(call(np.arange(m)), full[:m]):
            fail(f"the first {m} rows alone differ from the same rows in a batch of {len(x)}")
    for _ in range(N_MIXED):
        idx = rng.permutation(len(x))[: int(rng.integers(1, len(x) + 1))]
        if not _same_bits(call(idx), full[idx]):
            fail(f"rows {idx.tolist()} in that order differ from the same rows in another batch")


def self_test(kernel: Kernel, qtypes: Iterable[gguf.GGMLQuantizationType] = QTYPES, seed: int = 0, progress: Progress | None = None) -> None:
    """Raise ``KernelError`` unless *kernel* is batch invariant for every one of *qtypes* (random inputs);
    *progress* hears after each check (two per quant type)."""
    rng = np.random.default_rng(seed)
    d, n, ff, n_expert = 256, 48, 256, 4
    qtypes = list(qtypes)
    for step, qtype in enumerate(qtypes):
        # Rows of different magnitudes, so mixed batches mix activation scales (what quantized activations see).
        x = rng.standard_normal((MAX_ROWS, d)).astype(np.float32)
        x *= rng.uniform(0.1, 10.0, size=(MAX_ROWS, 1)).astype(np.float32)
        w = random_weight(qtype, (n, d), rng)
        _check(kernel, f"matmul {qtype.name} ({n}x{d})", lambda i: kernel.matmul(x[i], w, qtype, (n, d)), x, rng)
        if progress:
            progress(2 * step + 1, 2 * len(qtypes))
        gate = QuantWeight(random_expert_stack(qtype, n_expert, ff, d, rng), qtype, (n_expert, ff, d))
        up = QuantWeight(random_expert_stack(qtype, n_expert, ff, d, rng), qtype, (n_expert, ff, d))
        down = QuantWeight(random_expert_stack(qtype, n_expert, d, ff, rng), qtype, (n_expert, d, ff))
        experts = rng.integers(0, n_expert, size=MAX_ROWS).astype(np.int32)
        bias = ExpertBias(*(rng.standard_normal((n_expert, n)).astype(np.float32) for n in (ff, ff, d)))
        # gpt-oss's and step35's experts add element-wise ops (SwiGLU-OAI, add_id of the biases, clamps) after the same
        # matmuls: once is enough.
        plain = (SWIGLU, None)
        variants = (plain, (Glu(Activation.SWIGLU_OAI, OAI_LIMIT), bias), (Glu(Activation.SILU, 0.5), None)) if step == 0 else (plain,)
        for act, b in variants:

            def ffn(i: np.ndarray, act: Glu = act, b: ExpertBias | None = b) -> np.ndarray:
                return kernel.expert_ffn(x[i], experts[i], gate, up, down, act, b)

            _check(
                kernel,
                f"expert FFN {qtype.name} {act.act.value}{' clamped' if act.clamps else ''}{' + biases' if b else ''} ({n_expert} experts, {ff}x{d})",
                ffn,
                x,
                rng,
            )
        if progress:
            progress(2 * step + 2, 2 * len(qtypes))
