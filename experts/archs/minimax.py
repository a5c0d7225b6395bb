"""minimax-m2 (MiniMax-M2), src/models/minimax-m2.cpp: RMSNorm of the whole flattened Q and K, partial NEOX RoPE,
a gating function the file must name (NONE aborts build_moe_ffn), a required selection bias, renormalisation
hard-coded, no scale, no shared expert. Its loader shapes experts with feed_forward_length but still requires
expert_feed_forward_length.
"""

from __future__ import annotations

from ..arch import QKNorm
from .attention import Attention
from .base import Arch, FixedKey, RandomFeatures
from .ffn import Experts
from .router import GATING, Presence, RouterSpec

MINIMAX_M2 = Arch(
    name="minimax-m2",
    attention=Attention(qk_norm=QKNorm.WHOLE),
    router=RouterSpec(gating=None, norm=True, reads=(GATING,), selection_bias=Presence.REQUIRED),
    experts=Experts(width_key="feed_forward_length"),
    tied_output=False,
    fixed_keys=(FixedKey("expert_feed_forward_length"),),
    random=RandomFeatures(rot_div=2, gating="sigmoid"),
)
