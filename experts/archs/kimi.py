"""kimi-linear (Kimi-Linear-48B-A3B), src/models/kimi-linear.cpp.

Hybrid KDA / MLA attention (:mod:`.kda`), marked per layer by ``attention.head_count_kv`` (0: KDA); DeepSeek-V3's
MoE: the gating function from the file (required), a required ``exp_probs_b`` selection bias, renormalisation
hard-coded on (``expert_weights_norm`` is not read), the routed scale, leading dense layers and a plain shared
expert of ``expert_shared_count`` expert widths; ``output.weight`` is required.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelFormatError
from .base import Arch, RandomFeatures
from .ffn import DenseLead, SharedByCount
from .kda import KimiDeltaAttention
from .keys import Keys
from .router import GATING, SCALE, Presence, RouterSpec


@dataclass(frozen=True)
class KimiLinear(Arch):
    """head_count_kv is one entry per block: 0 on KDA layers, the MLA layers' one latent KV head elsewhere."""

    def read_heads(self, k: Keys, n_all: int) -> dict:
        heads = k.req("attention.head_count")
        if isinstance(heads, list):
            raise ModelFormatError(f"{k.prefix}attention.head_count is an array; kimi-linear runs one head count on every layer")
        kv = k.req("attention.head_count_kv")
        counts = tuple(int(x) for x in (kv if isinstance(kv, list) else [kv] * n_all))
        if len(counts) != n_all:
            raise ModelFormatError(f"{k.prefix}attention.head_count_kv has {len(counts)} entries; llama.cpp needs one per block ({n_all})")
        if set(counts) - {0, 1}:
            raise ModelFormatError(f"{k.prefix}attention.head_count_kv is {list(counts)}: kimi-linear layers have 0 (KDA) or 1 (absorbed MLA, one latent KV head)")
        return {"n_head": int(heads), "n_head_kv": 1, "n_head_kv_layers": counts, "layer_kinds": "".join("r" if c == 0 else "a" for c in counts)}

    def uses_rope(self, layer: int) -> bool:
        return False  # kimi-linear.cpp rotates nothing: its MLA layers are NoPE


KIMI_LINEAR = KimiLinear(
    name="kimi-linear",
    attention=KimiDeltaAttention(),
    router=RouterSpec(gating=None, norm=True, reads=(GATING, SCALE), selection_bias=Presence.REQUIRED),
    shared=SharedByCount(),
    schedule=DenseLead(),
    tied_output=False,
    # Kimi-Linear's router (sigmoid; routed scale 2.5, near its 2.446 and exact in float32 so configs read back
    # equal), one dense lead layer; MLA with V3's proportions (rope part nope/2, though un-rotated here)
    random=RandomFeatures(n_dense_lead=1, rot_div=3, gating="sigmoid", scale=2.5),
)
