"""The kernel interface: matrix products computed straight from a GGUF file's packed bytes.

A weight is handed to a kernel as it sits in the memory-mapped file (a uint8 view, no
copy), with its quant type and numpy shape; the kernel never keeps an F32 copy, so a
worker's resident memory for weights stays near their quantized size.

Every kernel must be *batch invariant*: a row's output bits depend only on that row
(and the weights), never on how many other rows share the call or what they hold.
``experts.kernels.selftest.self_test`` checks this on the running machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import gguf
import numpy as np

from ..moe import SWIGLU, Glu
from .identity import KernelIdentity

Q = gguf.GGMLQuantizationType

# Every type gguf-py can dequantize that the kernels here are tested with.
QTYPES: tuple[gguf.GGMLQuantizationType, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4,
)


@dataclass(frozen=True)
class QuantWeight:
    """Packed GGUF bytes of one 2-D weight (rows, cols) or a stack of experts (n_expert, rows, cols).

    ``data`` is a uint8 view: (rows, row_bytes) or (n_expert, rows * row_bytes); it may be a
    strided view (a fused gate_up tensor's gate half), as long as each row's bytes are contiguous.
    """

    data: np.ndarray
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return gguf.quant_shape_to_byte_shape((self.shape[-1],), self.qtype)[0]


@dataclass(frozen=True)
class ExpertBias:
    """float32 per-expert biases of a stack, indexed like its weights: gate, up (n_expert, ff), down (n_expert, d)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@runtime_checkable
class Kernel(Protocol):
    """What the engine needs from a compute kernel."""

    identity: KernelIdentity
    # True: the kernel computes on float32 weights it dequantizes per call, so a float32 cache of the hosted experts
    # buys speed (memory permitting); False: it computes on the packed bytes themselves, and a cache buys nothing.
    dequantizes: ClassVar[bool]

    def matmul(self, x: np.ndarray, weight: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
        """x (m, k) float32 times the packed weight of numpy *shape* (n, k), transposed: (m, n) float32."""
        ...

    def expert_ffn(
        self, x: np.ndarray, experts: np.ndarray, gate: QuantWeight, up: QuantWeight, down: QuantWeight, act: Glu = SWIGLU, bias: ExpertBias | None = None
    ) -> np.ndarray:
        """Gated FFN (*act* with its clamp, + *bias* after each projection) of expert ``experts[i]`` on row ``x[i]`` for every row: (m, d) float32.

        gate/up are stacks (n_expert, ff, d), down (n_expert, d, ff); a row's result is the same
        whichever other rows and experts share the call.
        """
        ...
