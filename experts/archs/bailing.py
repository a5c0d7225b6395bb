"""bailingmoe2 (Ling / Ring 2.0), src/models/bailingmoe2.cpp: fused attn_qkv, per-head q/k norms, partial NEOX RoPE,
DeepSeek-V3's router from the file (expert_gating_func required) with an optional selection bias, leading dense
layers, a plain shared expert of expert_shared_count units, untied output; MTP blocks (with a layer_output_norm) are
never run."""

from __future__ import annotations

from ..arch import QKNorm
from .attention import Attention
from .base import Arch, RandomFeatures
from .ffn import DenseLead, SharedByCount
from .router import FROM_FILE, Presence, RouterSpec

BAILINGMOE2 = Arch(
    name="bailingmoe2",
    attention=Attention(qk_norm=QKNorm.PER_HEAD, fused_qkv=True),
    router=RouterSpec(gating=None, reads=FROM_FILE, selection_bias=Presence.OPTIONAL),
    shared=SharedByCount(unit_key=True),
    schedule=DenseLead(),
    tied_output=False,
    mtp_norms=("layer_output_norm.weight",),
    random=RandomFeatures(n_dense_lead=1, n_nextn=1, rot_div=2, gating="sigmoid", norm_topk=True, scale=2.5, groups=(4, 2)),
)
