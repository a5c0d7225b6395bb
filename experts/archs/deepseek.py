"""deepseek2 (DeepSeek-V3 / V3.1 / R1, Kimi K2 / K2.5, DeepSeek-V2, GLM-4.7-Flash), src/models/deepseek2.cpp.

MLA (:mod:`.mla`: absorbed attn_k_b/attn_v_b, or legacy attn_kv_b) with q-LoRA and NORM RoPE, YaRN's mscale² in
the attention scale; DeepSeek-V3's router from the file (softmax unless it says) with an optional selection bias and
expert groups; leading dense layers; a plain shared expert of expert_shared_count expert widths.

deepseek32 (DeepSeek-V3.2), src/models/deepseek32.cpp, is this arch plus DeepSeek Sparse Attention
(:mod:`.dsa`: a lightning indexer picks the past positions each query's MLA reads); its loader requires the gating
function and q-LoRA.
"""

from __future__ import annotations

from .base import Arch, RandomFeatures
from .dsa import SparseLatentAttention
from .ffn import DenseLead, SharedByCount
from .mla import LatentAttention
from .router import FROM_FILE, Presence, RouterSpec

DEEPSEEK2 = Arch(
    name="deepseek2",
    attention=LatentAttention(random_ranks=(3, 2)),
    router=RouterSpec(reads=FROM_FILE, selection_bias=Presence.OPTIONAL),
    shared=SharedByCount(),
    schedule=DenseLead(),
    # DeepSeek-V3's router and schedule, a trailing MTP block (as GLM-4.7-Flash); MLA with V3's proportions (rope =
    # nope/2, v = nope; latent 2x and q-LoRA 3x nope, less than V3's 4x/12x); YaRN factor 4 over 64 positions with
    # V3's mscale_all_dim of 1
    random=RandomFeatures(n_dense_lead=1, n_nextn=1, rot_div=3, gating="sigmoid", norm_topk=True, scale=2.5, groups=(4, 2),
                          yarn_factor=4.0, yarn_orig_ctx=64, yarn_log_mul=1.0),
)

DEEPSEEK32 = Arch(
    name="deepseek32",
    attention=SparseLatentAttention(),
    router=RouterSpec(gating=None, reads=FROM_FILE, selection_bias=Presence.OPTIONAL),
    shared=SharedByCount(),
    schedule=DenseLead(),
    random=DEEPSEEK2.random,  # V3.2 keeps V3's router, schedule, MTP block and YaRN
)
