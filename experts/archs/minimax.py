"""minimax-m2 (MiniMax-M2), src/models/minimax-m2.cpp: RMSNorm of the whole flattened Q and K, partial NEOX RoPE,
a gating function the file must name (NONE aborts build_moe_ffn), a required selection bias, renormalisation
hard-coded, no scale, no shared expert. Its loader shapes experts with feed_forward_length but still requires
expert_feed_forward_length.

minimax-m3 (MiniMax-M3), src/models/minimax-m3.cpp: M2's attention with a per-head QK norm and MiniMax Sparse
Attention (:mod:`.msa`) past the leading dense layers; DeepSeek-V3's FFN side (leading dense layers, routed experts
with the file's gating, norm and scale, a required selection bias, expert_shared_count shared-expert widths), with
SwiGLU-OAI in all three FFNs (routed, shared and dense: ``dense_act``); output.weight required.
"""

from __future__ import annotations

from ..arch import Activation, QKNorm
from .attention import Attention
from .base import Arch, FixedKey, RandomFeatures
from .ffn import DenseLead, Experts, SharedByCount
from .msa import BlockSparseAttention
from .router import FROM_FILE, GATING, Presence, RouterSpec

MINIMAX_M2 = Arch(
    name="minimax-m2",
    attention=Attention(qk_norm=QKNorm.WHOLE),
    router=RouterSpec(gating=None, norm=True, reads=(GATING,), selection_bias=Presence.REQUIRED),
    experts=Experts(width_key="feed_forward_length"),
    tied_output=False,
    fixed_keys=(FixedKey("expert_feed_forward_length"),),
    random=RandomFeatures(rot_div=2, gating="sigmoid"),
)

MINIMAX_M3 = Arch(
    name="minimax-m3",
    attention=BlockSparseAttention(),
    router=RouterSpec(gating=None, reads=FROM_FILE, selection_bias=Presence.REQUIRED),
    experts=Experts(act=Activation.SWIGLU_OAI),
    dense_act=Activation.SWIGLU_OAI,
    shared=SharedByCount(),
    schedule=DenseLead(),
    tied_output=False,
    # one leading dense layer, half the head rotated, the converter's sigmoid gating with renormalisation and a
    # routed scale (MiniMax-M3's routed_scaling_factor)
    random=RandomFeatures(n_dense_lead=1, rot_div=2, gating="sigmoid", norm_topk=True, scale=2.5),
)
