"""olmoe (OLMoE-1B-7B), src/models/olmoe.cpp: RMSNorm of the whole flattened Q and K, NEOX RoPE, softmax without
renormalisation, expert width from feed_forward_length, untied output.

The K norm is n_embd wide and applied to the whole un-split K, so llama.cpp runs olmoe only with as many KV heads as
heads (with fewer, a d-wide k_norm aborts in ggml_mul; an n_kv*hd-wide one fails to load).
"""

from __future__ import annotations

from ..arch import QKNorm
from .attention import Attention
from .base import Arch
from .ffn import Experts

OLMOE = Arch(
    name="olmoe",
    attention=Attention(qk_norm=QKNorm.WHOLE, mha_only=True),
    experts=Experts(width_key="feed_forward_length"),
    tied_output=False,
)
