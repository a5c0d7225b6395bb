"""The portable reference kernel: today's numpy path, kept as the definition other kernels are checked against.

It dequantizes a weight to float32 on every call (nothing is cached, so memory stays at the
quantized size, at the cost of speed) and multiplies on zero-padded tiles of ``moe.TILE`` rows,
which makes OpenBLAS batch invariant. Its bits are exactly those of ``experts.moe.expert_ffn``
and ``experts.forward.mm`` on the dequantized weights.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import ClassVar

import gguf
import numpy as np

from ..gguf_model import dequantize_bytes
from ..moe import SWIGLU, Glu, expert_ffn, tiled_matmul
from .base import ExpertBias, QuantWeight
from .identity import KernelIdentity


def _expert_matrix(w: QuantWeight, expert: int) -> np.ndarray:
    return dequantize_bytes(w.data[expert], w.qtype, tuple(w.shape[1:]))


class ReferenceKernel:
    """numpy + gguf-py dequantization; every quant type gguf-py reads."""

    identity = KernelIdentity(library="numpy", version=np.__version__, build=("gguf-" + version("gguf"),))
    dequantizes: ClassVar[bool] = True

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads  # BLAS threads are the process's (OPENBLAS_NUM_THREADS); kept for a uniform signature

    def matmul(self, x: np.ndarray, weight: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
        w = dequantize_bytes(weight, qtype, tuple(shape))
        return tiled_matmul(np.ascontiguousarray(x, dtype=np.float32), w.T)

    def expert_ffn(
        self, x: np.ndarray, experts: np.ndarray, gate: QuantWeight, up: QuantWeight, down: QuantWeight, act: Glu = SWIGLU, bias: ExpertBias | None = None
    ) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        experts = np.asarray(experts)
        out = np.empty((x.shape[0], down.shape[1]), dtype=np.float32)
        for e in np.unique(experts):
            rows = np.nonzero(experts == e)[0]
            e = int(e)
            b = None if bias is None else (bias.gate[e], bias.up[e], bias.down[e])
            out[rows] = expert_ffn(x[rows], _expert_matrix(gate, e), _expert_matrix(up, e), _expert_matrix(down, e), act, b)
        return out
