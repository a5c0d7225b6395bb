"""Expert FFNs served straight from a model's (or slice's) memory-mapped packed bytes through a kernel.

Today's ``slices.ExpertStore`` either caches every hosted expert dequantized to float32 (~7x the
Q4_K file in memory) or dequantizes per dispatch (~12x slower). ``PackedExperts`` does neither:
it hands the kernel views into the file's memory map, so resident memory for weights is the
pages of the experts actually used, at most the file size, and compute runs on the packed bytes.

Its ``partial_sum`` is ``moe.partial_sum`` with one kernel call for every (token, held slot)
pair instead of one FFN per expert; the weighting and the slot-order sum are the same code, so
with the reference kernel its bits are exactly today's (tested), and with another kernel they
are that kernel's (batch invariant, as its self-test proves).
"""

from __future__ import annotations

import numpy as np

from .arch import EXPERT_BIASES, FUSED_GATE_UP
from .errors import SliceError
from .gguf_model import ExpertRange, GGUFModel
from .kernels import ExpertBias, Kernel, KernelIdentity, QuantWeight
from .moe import Progress, ordered_sum
from .slices import HostedExperts, hosted_part


class PackedExperts(HostedExperts):
    """The experts of *layers* x *experts* of a GGUF model or slice, computed in place by *kernel*."""

    def __init__(self, model: GGUFModel, kernel: Kernel, layers: range | None = None, experts: ExpertRange | None = None) -> None:
        self.model = model
        self.kernel = kernel
        self.layers, self.experts = hosted_part(model, layers, experts)
        self._stacks: dict[int, tuple[QuantWeight, QuantWeight, QuantWeight]] = {}
        self._biases: dict[int, ExpertBias | None] = {}

    @property
    def identity(self) -> KernelIdentity:
        return self.kernel.identity

    def warm(self, progress: Progress | None = None) -> None:
        """Fault every page of the hosted experts in (a byte per page), so the first dispatches do not."""
        first = self.experts.start - self.model.experts.start
        layers = list(filter(self.model.cfg.is_moe, self.layers))
        for done, layer in enumerate(layers, 1):
            for w in self.stacks(layer):
                for e in range(first, first + len(self.experts)):  # per expert: a progress step stays short
                    int(w.data[e, ::4096].sum())
            if progress:
                progress(done, len(layers))

    def stacks(self, layer: int) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
        """(gate, up, down) of *layer* as zero-copy views of the file, indexed by local expert."""
        got = self._stacks.get(layer)
        if got is None:
            m = self.model
            kinds = m.expert_kinds(layer)
            views = []
            for kind in kinds:
                name = f"blk.{layer}.{kind}.weight"
                views.append(QuantWeight(m.raw(name).reshape(m.shape(name)[0], -1), m.qtype(name), m.shape(name)))
            if kinds[0] == FUSED_GATE_UP:  # gate rows first, then up: two strided halves of each expert
                fused, down = views
                n, two_ff, d = fused.shape
                half = fused.data.shape[1] // 2
                views = [QuantWeight(fused.data[:, :half], fused.qtype, (n, two_ff // 2, d)), QuantWeight(fused.data[:, half:], fused.qtype, (n, two_ff // 2, d)), down]
            got = self._stacks[layer] = (views[0], views[1], views[2])
        return got

    def stack_biases(self, layer: int) -> ExpertBias | None:
        """The expert biases of *layer* as float32 stacks by local expert (None if the arch has none)."""
        if layer not in self._biases:
            m = self.model
            self._biases[layer] = ExpertBias(*(m.dense(f"blk.{layer}.{b}") for b in EXPERT_BIASES)) if m.cfg.spec.experts.biases else None
        return self._biases[layer]

    def ffn(self, layer: int, x: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """The FFN of expert ``experts[i]`` (global index) on row ``x[i]``, for every row."""
        experts = np.asarray(experts)
        if len(experts) and not all(self.holds(layer, int(e)) for e in np.unique(experts)):
            raise SliceError(f"an expert of {np.unique(experts).tolist()} of layer {layer} is not hosted here")
        local = (experts - self.model.experts.start).astype(np.int32)
        return self.kernel.expert_ffn(x, local, *self.stacks(layer), self.glu(layer), self.stack_biases(layer))

    def weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dequantized weights of one expert (for callers of the ExpertSource interface; not cached)."""
        if not self.holds(layer, expert):
            raise SliceError(f"expert {expert} of layer {layer} is not hosted here")
        return self.model.expert_weights(layer, expert)

    def partial_sum(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, weights: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``moe.partial_sum`` through the kernel: every held (token, slot) pair in one call."""
        n, k = expert_ids.shape
        contrib = np.zeros((n, k, x.shape[1]), dtype=np.float32)
        rows, slots = np.nonzero(held)
        if len(rows):
            y = self.ffn(layer, x[rows], expert_ids[rows, slots])
            contrib[rows, slots] = weights[rows, slots][:, None] * y
        return ordered_sum(contrib, held)
