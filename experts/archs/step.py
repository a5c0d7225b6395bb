"""step35 (Step-3.5-Flash / Step-3.7-Flash), src/models/step35.cpp.

Per-layer head counts and SWA flags, full-attention layers rotating half the RoPE dims with llama3 rope_freqs and
SWA layers all of them with their own base, optional per-head q/k norms, a per-head sigmoid output gate;
DeepSeek-V3's router from the file (sigmoid by default) with an optional selection bias, leading dense layers, a
plain shared expert, per-layer SwiGLU clamps (routed experts; shared experts and dense FFNs); MTP blocks never run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import gguf
import numpy as np

from ..arch import Gating, QKNorm
from ..errors import ModelFormatError
from .attention import Attention
from .base import Arch, RandomFeatures
from .ffn import DenseLead, SharedByWidth
from .keys import Keys
from .router import FROM_FILE, Presence, RouterSpec
from .window import LayerWindow

if TYPE_CHECKING:
    from ..config import ModelConfig

CLAMPS = (("swiglu_clamp_exp", "clamp_exp"), ("swiglu_clamp_shexp", "clamp_shexp"))
# random models: per-layer clamps (routed / shared + dense), cycled over the layers, tight enough to clip on random
# weights (gate and up ~ N(0, 1))
RANDOM_CLAMPS = ((0.0, 1.0, 0.75), (0.5, 1.25, 1.0))


@dataclass(frozen=True)
class Step35(Arch):
    per_layer_heads: ClassVar[bool] = True

    def read_extra(self, k: Keys, n_all: int) -> dict:
        """The SwiGLU clamps, a number or one per block (both optional: none means no clamp), as float32 values."""
        out = {}
        for key, field_ in CLAMPS:
            value = k.opt(key, None)
            if value is None:
                continue
            values = value if isinstance(value, list) else [value] * n_all
            if len(values) != n_all:
                raise ModelFormatError(f"{k.prefix}{key} has {len(values)} entries; llama.cpp needs one per block ({n_all})")
            if any(v > 1e-6 for v in values):
                out[field_] = tuple(float(np.float32(v)) for v in values)
        return out

    def write_extra(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if cfg.clamp_exp:
            w.add_swiglu_clamp_exp(list(cfg.clamp_exp))
        if cfg.clamp_shexp:
            w.add_swiglu_clamp_shexp(list(cfg.clamp_shexp))

    def random_extra(self, cfg: ModelConfig) -> ModelConfig:
        """Odd layers SWA with 3/2 the heads (when that divides), :data:`RANDOM_CLAMPS` cycled over the layers."""
        n_all = cfg.n_layer + cfg.n_nextn
        swa = tuple(i % 2 == 1 for i in range(n_all))
        wide = cfg.n_head % 2 == 0 and cfg.n_head_kv % 2 == 0

        def per_layer(n: int) -> tuple[int, ...]:
            return tuple(n * 3 // 2 if s and wide else n for s in swa)

        exp, shexp = RANDOM_CLAMPS
        return dataclasses.replace(
            cfg,
            n_head_layers=per_layer(cfg.n_head) if wide else (),
            n_head_kv_layers=per_layer(cfg.n_head_kv) if wide else (),
            swa_pattern=swa,
            clamp_exp=tuple(exp[i % len(exp)] for i in range(n_all)),
            clamp_shexp=tuple(shexp[i % len(shexp)] for i in range(n_all)),
        )

    def rope_dim_at(self, cfg: ModelConfig, layer: int) -> int:
        """Full-attention layers rotate half of rope.dimension_count (llama.cpp's n_rot_full /= 2), SWA layers all."""
        return cfg.rope_dim if cfg.is_swa(layer) else cfg.rope_dim // 2

    def rope_factors(self, cfg: ModelConfig, layer: int, factors: np.ndarray | None) -> np.ndarray | None:
        """rope_freqs only on full-attention layers."""
        return None if cfg.is_swa(layer) else factors


STEP35 = Step35(
    name="step35",
    attention=Attention(
        qk_norm=QKNorm.PER_HEAD,
        head_gate=True,
        rope_freqs=True,
        optional=("attn_q_norm.weight", "attn_k_norm.weight", "attn_gate.weight"),
    ),
    router=RouterSpec(gating=Gating.SIGMOID, reads=FROM_FILE, selection_bias=Presence.OPTIONAL),
    shared=SharedByWidth(),
    schedule=DenseLead(),
    window=LayerWindow(rope_base=10000.0),
    tied_output=False,
    # a dense lead, odd layers SWA (a 4-token window, their own RoPE base, half again as many heads: random_extra),
    # DeepSeek-V3's router with groups, an MTP block
    random=RandomFeatures(n_dense_lead=1, n_nextn=1, gating="sigmoid", norm_topk=True, scale=2.5, groups=(4, 2), n_swa=4, rope_theta_swa=2000.0),
)
