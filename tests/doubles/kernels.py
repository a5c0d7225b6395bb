"""Kernels made to break batch invariance on purpose, so tests can check the self-test refuses them."""

from __future__ import annotations

import numpy as np

from experts.kernels import KernelIdentity, ReferenceKernel
from experts.moe import SWIGLU


class VaryingKernel:
    """The reference kernel, except that a row's last bit flips when *batch* or more rows share a call
    (what a kernel that switches to a repacked path for big batches does) or, with ``neighbours=True``,
    depending on what the other rows hold."""

    dequantizes = True

    def __init__(self, batch: int = 8, neighbours: bool = False) -> None:
        self.inner = ReferenceKernel()
        self.batch = batch
        self.neighbours = neighbours
        self.identity = KernelIdentity(library="varying-double", version="0", build=(f"batch>={batch}",))

    def _vary(self, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        if self.neighbours:
            others = x[:, :1].sum() - x[:, :1]  # what the other rows hold
            return (y + np.float32(1e-6) * others).astype(np.float32)
        if len(x) >= self.batch:
            return np.nextafter(y, np.float32(np.inf), dtype=np.float32)
        return y

    def matmul(self, x, weight, qtype, shape):
        return self._vary(self.inner.matmul(x, weight, qtype, shape), x)

    def expert_ffn(self, x, experts, gate, up, down, act=SWIGLU, bias=None):
        return self._vary(self.inner.expert_ffn(x, experts, gate, up, down, act, bias), x)
