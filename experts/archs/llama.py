"""llama (Mixtral and llama-with-experts) and llama4 (Llama-4-Scout / Maverick).

src/models/llama.cpp: NORM RoPE, softmax with renormalised top-k, expert width from feed_forward_length.
src/models/llama4.cpp: sigmoid top-1 on the raw logits with the weight multiplied into the expert's input, an
un-gated shared expert as wide as a routed one, MoE every interleave_moe_layer_step-th layer (dense FFN between),
NORM RoPE with llama3 frequency factors, chunked attention (8192) on 3 of 4 layers, NoPE every 4th layer with
temperature-scaled queries, a weightless q/k RMS norm after RoPE (not for 128-expert models: llama.cpp's
``use_kq_norm`` is false for 17B_128E).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..arch import Gating, QKNorm, RopeStyle
from .attention import Attention
from .base import Arch, RandomFeatures
from .ffn import Experts, Interleaved, SharedAsExpert
from .router import RouterSpec
from .window import ChunkedWindow

if TYPE_CHECKING:
    from ..config import ModelConfig

LLAMA = Arch(
    name="llama",
    attention=Attention(rope=RopeStyle.NORM),
    router=RouterSpec(norm=True),
    experts=Experts(width_key="feed_forward_length"),
)


@dataclass(frozen=True)
class Llama4(Arch):
    nope_period: ClassVar[int] = 4  # layer i has no RoPE (and no q/k norm) iff (i + 1) % 4 == 0
    # NoPE layers scale q by log(floor((pos + offset) / floor_) + 1) * scale + 1: (floor_, scale, offset)
    attn_temp: ClassVar[tuple[float, float, float] | None] = (8192.0, 0.1, 1.0)
    kq_norm_off_at: ClassVar[int] = 128  # no q/k norm for models with this many experts

    def uses_rope(self, layer: int) -> bool:
        return (layer + 1) % self.nope_period != 0

    def qk_norm_after_rope(self, cfg: ModelConfig) -> bool:
        return cfg.n_expert != self.kq_norm_off_at


LLAMA4 = Llama4(
    name="llama4",
    attention=Attention(rope=RopeStyle.NORM, qk_norm=QKNorm.WEIGHTLESS_AFTER_ROPE, rope_freqs=True),
    router=RouterSpec(gating=Gating.SIGMOID, select_on_logits=True, weight_before_expert=True),
    shared=SharedAsExpert(),
    schedule=Interleaved(),
    window=ChunkedWindow(chunk=8192, period=4),
    # experts on every 2nd layer (dense FFNs between, as Maverick); chunks of 8192 and the temperature only show
    # past position 8190
    random=RandomFeatures(moe_step=2),
)
