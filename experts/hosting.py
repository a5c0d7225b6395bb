"""How a node holds the experts it hosts: which source computes them, and the memory that takes.

A worker (and a backbone's local fallback) picks one of three ways, by kernel and budget:

* ``packed`` — a fast kernel (ggml) computes on the file's memory-mapped quantized bytes
  (``PackedExperts``); resident memory for the experts tends to their packed size.
* ``cached`` — the reference kernel with every hosted expert dequantized once to float32
  (``ExpertStore``); ~7x a Q4_K file, but the portable numpy numerics at full speed.
* ``on-the-fly`` — the reference kernel dequantizing per dispatch from the map (the packed size
  again, ~12x slower than cached): the reference when the float32 cache does not fit.

``plan_load`` decides before anything is read and refuses, with the numbers, a budget that
even the packed bytes exceed: a phone must learn at start-up that its slice cannot fit, not
when the kernel's page faults push it out of memory mid-dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SliceError
from .gguf_model import ExpertRange, GGUFModel
from .kernels import Kernel
from .moe import ExpertSource
from .packed_experts import PackedExperts
from .slices import ExpertStore, hosted_part

MB = 1 << 20


@dataclass(frozen=True)
class LoadPlan:
    mode: str  # "packed", "cached" or "on-the-fly" (see the module docstring)
    resident_bytes: int  # what the hosted experts hold in memory in this mode (at most)
    packed_bytes: int  # their quantized bytes in the file
    float_bytes: int  # what a float32 cache of them would take
    budget: int | None

    def describe(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget / MB:.1f} MB"
        return f"{self.mode}: {self.resident_bytes / MB:.1f} MB resident ({self.packed_bytes / MB:.1f} MB packed, {self.float_bytes / MB:.1f} MB as float32; {budget})"


def packed_bytes(model: GGUFModel, layers: range, experts: ExpertRange) -> int:
    """Bytes of the packed weights (and expert biases) of *layers* x *experts* in *model*'s file (dense layers have none)."""
    total = 0
    for i in filter(model.cfg.is_moe, layers):
        for name in model.expert_tensors(i):
            total += model.tensors[name].n_bytes // model.shape(name)[0] * len(experts)
    return total


def float_bytes(model: GGUFModel, layers: range, experts: ExpertRange) -> int:
    """What a float32 cache of *layers* x *experts* takes (gate, up and down of each expert, and their biases)."""
    cfg = model.cfg
    per_expert = 3 * cfg.n_ff_exp * cfg.n_embd + ((2 * cfg.n_ff_exp + cfg.n_embd) if cfg.spec.experts.biases else 0)
    return per_expert * 4 * sum(map(cfg.is_moe, layers)) * len(experts)


def plan_load(model: GGUFModel, kernel: Kernel | type[Kernel], memory_budget: int | None = None, layers: range | None = None, experts: ExpertRange | None = None) -> LoadPlan:
    """The cheapest-to-compute way to hold *layers* x *experts* within *memory_budget* bytes, or a SliceError."""
    layers, experts = hosted_part(model, layers, experts)
    packed = packed_bytes(model, layers, experts)
    floats = float_bytes(model, layers, experts)
    if not kernel.dequantizes:
        mode, resident = "packed", packed
    elif memory_budget is None or floats <= memory_budget:
        mode, resident = "cached", floats
    else:
        mode, resident = "on-the-fly", packed
    if memory_budget is not None and resident > memory_budget:
        raise SliceError(
            f"the hosted experts (layers {layers.start}-{layers.stop - 1}, experts {experts}) need {resident / MB:.1f} MB "
            f"resident ({packed / MB:.1f} MB packed in the file), more than the memory budget of {memory_budget / MB:.1f} MB; "
            "host fewer layers or experts (--layers / --experts), or cut a smaller slice"
        )
    return LoadPlan(mode, resident, packed, floats, memory_budget)


def open_experts(model: GGUFModel, kernel: Kernel, layers: range | None = None, experts: ExpertRange | None = None, *, memory_budget: int | None = None) -> tuple[ExpertSource, LoadPlan]:
    """The source that computes the hosted experts as ``plan_load`` decided, with that plan."""
    plan = plan_load(model, kernel, memory_budget, layers, experts)
    if plan.mode == "packed":
        return PackedExperts(model, kernel, layers, experts), plan
    return ExpertStore(model, layers, experts, cache=plan.mode == "cached"), plan
