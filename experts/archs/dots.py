"""dots1 (rednote dots.llm1), src/models/dots1.cpp: qwen3-style attention (per-head q/k norms, NEOX) with K/V sized
for n_head heads, DeepSeek-V3's router from the file (the gating is required in practice: none aborts build_moe_ffn)
with an optional selection bias, leading dense layers, a plain shared expert of expert_shared_count widths, untied
output."""

from __future__ import annotations

from ..arch import QKNorm
from .attention import Attention
from .base import Arch, RandomFeatures
from .ffn import DenseLead, SharedByCount
from .router import FROM_FILE, Presence, RouterSpec

DOTS1 = Arch(
    name="dots1",
    attention=Attention(qk_norm=QKNorm.PER_HEAD, mha_only=True),
    router=RouterSpec(gating=None, reads=FROM_FILE, selection_bias=Presence.OPTIONAL),
    shared=SharedByCount(),
    schedule=DenseLead(),
    tied_output=False,
    random=RandomFeatures(n_dense_lead=1, gating="sigmoid", norm_topk=True, scale=2.5, groups=(4, 2)),
)
