"""The backbone's dense weights (attention, router, shared expert, embedding, output head), two ways.

* ``DenseLinear`` / ``DenseFFN``: today's path, each matrix dequantized to float32 once and
  multiplied on batch-invariant numpy tiles (``forward.mm``). Its bits are the reference
  digests and tests are written against; it keeps ~7x a Q4_K file's size resident.
* ``PackedLinear`` / ``PackedFFN``: a kernel (``experts.kernels``) computes on the weight's
  packed bytes in the file's memory map; nothing is dequantized up front, so resident memory for
  the weights stays near their quantized size. With ``ReferenceKernel`` the bits equal the dense
  path's (it dequantizes per call and uses the same tiles); with a fast kernel they are that
  kernel's (batch invariant, as its self-test proves).

``weights_for(model, kernel)`` picks the way: no kernel means today's dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_model import GGUFModel, dequantize_bytes
from .kernels import Kernel, QuantWeight
from .moe import SWIGLU, Glu, expert_ffn, tiled_matmul


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T, batch invariant (fixed row tiles): a token's bits never depend on its batch-mates."""
    return tiled_matmul(x, w.T)


@dataclass(frozen=True)
class DenseLinear:
    """x @ W.T on a float32 copy of W (today's path)."""

    w: np.ndarray

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return mm(x, self.w)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows *ids* of W (an embedding lookup)."""
        return self.w[ids]


@dataclass(frozen=True)
class PackedLinear:
    """x @ W.T computed by *kernel* on W's packed bytes (a view into the memory-mapped file)."""

    w: QuantWeight
    kernel: Kernel

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.kernel.matmul(x, self.w.data, self.w.qtype, (self.w.shape[0], self.w.shape[1]))

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows *ids* of W, dequantized on demand (gguf dequantizes block by block: same bits as the whole tensor's)."""
        return dequantize_bytes(self.w.data[ids], self.w.qtype, (len(ids), self.w.shape[1]))


@dataclass(frozen=True)
class DenseFFN:
    """SwiGLU (clamped where the layer says: step35) on float32 copies of (gate, up, down) (today's path)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    glu: Glu = SWIGLU

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return expert_ffn(x, self.gate, self.up, self.down, self.glu)


@dataclass(frozen=True)
class PackedFFN:
    """SwiGLU through the kernel's expert FFN, the three matrices as a one-expert stack of packed bytes."""

    gate: QuantWeight
    up: QuantWeight
    down: QuantWeight
    kernel: Kernel
    glu: Glu = SWIGLU

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.kernel.expert_ffn(x, np.zeros(x.shape[0], dtype=np.int32), self.gate, self.up, self.down, self.glu)


Linear = DenseLinear | PackedLinear
FFN = DenseFFN | PackedFFN


class DenseWeights:
    """Today's backbone weights: every matrix dequantized to float32 when the backbone is built."""

    def __init__(self, model: GGUFModel) -> None:
        self.model = model

    def linear(self, name: str, rows: slice = slice(None)) -> DenseLinear:
        """The matrix *name*, or a range of its rows (one projection of a fused attn_qkv)."""
        return DenseLinear(np.ascontiguousarray(self.model.dense(name)[rows]))

    def ffn(self, gate: str, up: str, down: str, glu: Glu = SWIGLU) -> DenseFFN:
        return DenseFFN(self.model.dense(gate), self.model.dense(up), self.model.dense(down), glu)

    def stacked(self, name: str) -> list[DenseLinear]:
        """One linear per outermost index of a 3-D tensor (deepseek2's per-head attn_k_b / attn_v_b)."""
        return [DenseLinear(w) for w in self.model.dense(name)]


class PackedWeights:
    """Backbone weights left packed in the model's memory map, computed on by *kernel*."""

    def __init__(self, model: GGUFModel, kernel: Kernel) -> None:
        self.model = model
        self.kernel = kernel

    def _packed(self, name: str, stack: bool = False) -> QuantWeight:
        m = self.model
        shape = m.shape(name)
        data = m.raw(name)
        return QuantWeight(data.reshape(1, -1), m.qtype(name), (1, *shape)) if stack else QuantWeight(data, m.qtype(name), shape)

    def linear(self, name: str, rows: slice = slice(None)) -> PackedLinear:
        """The matrix *name*, or a range of its rows: whole rows of blocks, so a view of the same packed bytes."""
        w = self._packed(name)
        data = w.data[rows]
        return PackedLinear(QuantWeight(data, w.qtype, (data.shape[0], w.shape[1])), self.kernel)

    def ffn(self, gate: str, up: str, down: str, glu: Glu = SWIGLU) -> PackedFFN:
        return PackedFFN(self._packed(gate, True), self._packed(up, True), self._packed(down, True), self.kernel, glu)

    def stacked(self, name: str) -> list[PackedLinear]:
        """One linear per outermost index of a 3-D tensor, each on its own (contiguous) bytes of the map."""
        m = self.model
        n, rows, cols = m.shape(name)
        return [PackedLinear(QuantWeight(block.reshape(rows, -1), m.qtype(name), (rows, cols)), self.kernel) for block in m.raw(name)]


def weights_for(model: GGUFModel, kernel: Kernel | None) -> DenseWeights | PackedWeights:
    """Today's float32 copies without a kernel; the packed bytes through *kernel* with one."""
    return DenseWeights(model) if kernel is None else PackedWeights(model, kernel)
