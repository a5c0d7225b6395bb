"""The FFN side of an arch: the routed experts, the shared expert, and which layers have experts at all.

Each shared-expert kind is one class: how llama.cpp learns its width from the file (four different ways), what the
writer stores, its tensors, and how wide a random model's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gguf

from ..arch import Activation
from ..errors import ModelFormatError
from .attention import Shapes
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig

SHEXP_WIDTH = "expert_shared_feed_forward_length"


@dataclass(frozen=True)
class Experts:
    """The routed experts: stacked (n_expert, rows, cols) ffn_{gate,up,down}_exps."""

    width_key: str = "expert_feed_forward_length"  # the GGUF key holding the expert FFN width
    act: Activation = Activation.SILU
    biases: bool = False  # ffn_{gate,up,down}_exps.bias: per-expert biases, sliced and proven like the weights

    def shapes(self, cfg: ModelConfig, b: str) -> Shapes:
        e, ff, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        return {b + "ffn_gate_exps.weight": (e, ff, d), b + "ffn_up_exps.weight": (e, ff, d), b + "ffn_down_exps.weight": (e, d, ff)}

    def bias_shapes(self, cfg: ModelConfig, b: str) -> Shapes:
        if not self.biases:
            return {}
        e, ff, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        return {b + "ffn_gate_exps.bias": (e, ff), b + "ffn_up_exps.bias": (e, ff), b + "ffn_down_exps.bias": (e, d)}


@dataclass(frozen=True)
class SharedExpert:
    """No shared expert: llama.cpp would refuse a file with its tensors."""

    gated: bool = False  # its output times sigmoid(ffn_gate_inp_shexp . x) (qwen2moe)

    def read(self, k: Keys, n_ff_exp: int) -> int:
        """Its width from the file (0: none)."""
        return 0

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        """The keys that give its width back."""

    def random_width(self, arch: str, n_ff_exp: int, asked: int | None) -> int:
        return 0

    def required_keys(self) -> set[str]:
        return set()

    def shapes(self, cfg: ModelConfig, b: str) -> Shapes:
        s, d = cfg.n_ff_shexp, cfg.n_embd
        if not s:
            return {}
        gate = {b + "ffn_gate_inp_shexp.weight": (d,)} if self.gated else {}
        return gate | {b + "ffn_gate_shexp.weight": (s, d), b + "ffn_up_shexp.weight": (s, d), b + "ffn_down_shexp.weight": (d, s)}


NO_SHARED = SharedExpert()


@dataclass(frozen=True)
class SharedByWidth(SharedExpert):
    """Width from expert_shared_feed_forward_length (0 or absent: none), else feed_forward_length if *fallback*
    (qwen2moe's loader); without fallback the key alone decides (ernie4_5-moe, step35)."""

    fallback: bool = False

    def read(self, k: Keys, n_ff_exp: int) -> int:
        n = int(k.opt(SHEXP_WIDTH, 0))
        return n or (int(k.req("feed_forward_length")) if self.fallback else 0)

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if cfg.n_ff_shexp:
            w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)

    def random_width(self, arch: str, n_ff_exp: int, asked: int | None) -> int:
        return 2 * n_ff_exp if asked is None else asked


@dataclass(frozen=True)
class SharedByCount(SharedExpert):
    """expert_shared_count (required) units of the expert width (DeepSeek-V3 style); with *unit_key* the unit is
    expert_shared_feed_forward_length when the file has it (bailingmoe2)."""

    unit_key: bool = False

    def read(self, k: Keys, n_ff_exp: int) -> int:
        n_shared = int(k.req("expert_shared_count"))
        if n_shared < 1:  # measured: llama.cpp's graph then computes another model (cosine ~0.93 to ours)
            raise ModelFormatError(f"{k.prefix}expert_shared_count is 0: {k.arch} models have a shared expert (llama.cpp's graph assumes one)")
        unit = int(k.opt(SHEXP_WIDTH, 0)) if self.unit_key else 0
        return (unit or n_ff_exp) * n_shared

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        w.add_expert_shared_count(cfg.n_ff_shexp // cfg.n_ff_exp)

    def random_width(self, arch: str, n_ff_exp: int, asked: int | None) -> int:
        width = 2 * n_ff_exp if asked is None else asked
        if width % n_ff_exp:
            raise ModelFormatError(f"{arch} stores the shared expert as a count of expert widths: {width} is not a multiple of {n_ff_exp}")
        return width

    def required_keys(self) -> set[str]:
        return {"expert_shared_count"}


@dataclass(frozen=True)
class SharedAsExpert(SharedExpert):
    """As wide as a routed expert, always on (llama4: llama.cpp reads no width, n_ff_shexp = n_ff_exp)."""

    def read(self, k: Keys, n_ff_exp: int) -> int:
        return n_ff_exp

    def random_width(self, arch: str, n_ff_exp: int, asked: int | None) -> int:
        return n_ff_exp


@dataclass(frozen=True)
class Schedule:
    """Every layer routes to experts."""

    def read(self, k: Keys, n_layer: int) -> dict:
        """n_dense_lead / moe_step of the config, where the arch reads them."""
        return {}

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        """The key :meth:`read` reads."""

    def required_keys(self) -> set[str]:
        return set()


ALL_MOE = Schedule()


@dataclass(frozen=True)
class DenseLead(Schedule):
    """Layers below leading_dense_block_count (optional, 0) have a dense FFN (ffn_gate/up/down) instead of experts."""

    def read(self, k: Keys, n_layer: int) -> dict:
        return {"n_dense_lead": int(k.opt("leading_dense_block_count", 0))}

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if cfg.n_dense_lead:
            w.add_leading_dense_block_count(cfg.n_dense_lead)


@dataclass(frozen=True)
class Interleaved(Schedule):
    """interleave_moe_layer_step (required): layer i has experts iff (i + 1) % step == 0 (llama4)."""

    def read(self, k: Keys, n_layer: int) -> dict:
        step = int(k.req("interleave_moe_layer_step"))
        if not 0 < step <= n_layer:
            raise ModelFormatError(f"{k.prefix}interleave_moe_layer_step is {step}: with {n_layer} layers that leaves no MoE layer")
        return {"moe_step": step}

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if cfg.moe_step:
            w.add_interleave_moe_layer_step(cfg.moe_step)

    def required_keys(self) -> set[str]:
        return {"interleave_moe_layer_step"}
