"""Kimi Delta Attention (kimi-linear): keys, tensors, writer and random fields of its hybrid layers.

src/models/kimi-linear.cpp: a layer whose ``attention.head_count_kv`` entry is 0 is a KDA layer (recurrent), the
others are MLA (:class:`.mla.LatentAttention`, absorbed, one latent KV head, no q-LoRA, and no RoPE at all: the
``rope.dimension_count`` dims of each head are a plain un-rotated part). A KDA layer runs the delta rule of
:mod:`.gdn`'s gated delta-net with three differences: separate q/k/v projections each through its own causal conv1d,
one decay per *key dimension* (``g = softplus(f_b(f_a(x)) + dt_bias) * ssm_a``, ssm_a = -exp(A_log) per head), and an
output gate ``sigmoid(g_b(g_a(x)))`` instead of silu(z). Every KDA layer has ``n_head`` heads of ``kda.head_dim``,
as many key heads as value heads. Numerics: :mod:`experts.kda` over :mod:`experts.delta_net`'s scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import gguf

from ..errors import ModelFormatError
from .attention import Shapes
from .keys import Keys
from .mla import LatentAttention

if TYPE_CHECKING:
    from ..config import ModelConfig

RANDOM_MLA_INTERVAL = 2  # random models: MLA every 2nd layer, so 3 layers hold both kinds (Kimi-Linear: every 4th)
QKV = ("q", "k", "v")


@dataclass(frozen=True)
class KimiDeltaAttention(LatentAttention):
    """Recurrent layers (``cfg.layer_kinds``) of KDA, the others NoPE MLA."""

    random_ranks: tuple[int, int] = (0, 2)  # llama.cpp's kimi-linear loader reads no q_lora_rank: one attn_q
    key_decay: ClassVar[bool] = True

    def read(self, k: Keys, head_dim: int, n_layer: int) -> dict:
        """The MLA keys (absorbed layout only), ``ssm.conv_kernel`` and ``kda.head_dim``; the layer schedule comes from
        the head_count_kv array (:meth:`experts.archs.kimi.KimiLinear.read_heads`)."""
        for key in ("attention.key_length_mla", "attention.value_length_mla"):  # required: no legacy attn_kv_b layout
            k.req(key)  # (llama.cpp's kimi-linear fallback for it puts the k_pe part first in K but last in Q)
        fields = super().read(k, head_dim, n_layer)
        if fields["q_lora_rank"]:
            raise ModelFormatError(f"{k.prefix}attention.q_lora_rank is {fields['q_lora_rank']}: llama.cpp's kimi-linear loader does not read it (its MLA layers have one attn_q)")
        conv, state = int(k.req("ssm.conv_kernel")), int(k.req("kda.head_dim"))
        if conv < 2 or state < 1:
            raise ModelFormatError(f"{k.prefix}ssm.conv_kernel {conv} / kda.head_dim {state}: KDA needs a conv of at least 2 taps and a head of at least 1")
        n_head = int(k.req("attention.head_count"))
        return fields | {"ssm_conv": conv, "ssm_state": state, "ssm_k_heads": n_head, "ssm_v_heads": n_head}

    def shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        if not cfg.is_recurrent(i):
            return super().shapes(cfg, i, b)
        d, S, inner = cfg.n_embd, cfg.ssm_state, cfg.gdn_value_dim  # kimi-linear.cpp load_arch_tensors, in its order
        shapes: Shapes = {b + f"ssm_conv1d_{x}.weight": (inner, 1, cfg.ssm_conv) for x in QKV}
        shapes |= {b + f"attn_{x}.weight": (inner, d) for x in QKV}
        return shapes | {
            b + "ssm_f_a.weight": (S, d),
            b + "ssm_f_b.weight": (inner, S),
            b + "ssm_beta.weight": (cfg.ssm_v_heads, d),
            b + "ssm_a": (cfg.ssm_v_heads, 1),
            b + "ssm_dt.bias": (inner,),
            b + "ssm_g_a.weight": (S, d),
            b + "ssm_g_b.weight": (inner, S),
            b + "ssm_norm.weight": (S,),
            b + "attn_output.weight": (d, inner),
        }

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        super().write(w, cfg)
        w.add_ssm_conv_kernel(cfg.ssm_conv)
        w.add_kda_head_dim(cfg.ssm_state)

    def required_keys(self) -> set[str]:
        return super().required_keys() | {"attention.key_length_mla", "attention.value_length_mla", "ssm.conv_kernel", "kda.head_dim"}

    def random_fields(self, head_dim: int, n_head: int, n_head_kv: int, n_layer: int, mla_kv_b: bool) -> dict:
        """MLA as deepseek2's random models (latent 2x qk_nope, rope part half of it, but no q-LoRA); KDA heads of
        *head_dim*, conv 4 (Kimi-Linear's kernel)."""
        if mla_kv_b:
            raise ModelFormatError("kimi-linear runs the absorbed MLA layout only (attn_k_b / attn_v_b)")
        kinds = "".join("a" if (i + 1) % RANDOM_MLA_INTERVAL == 0 else "r" for i in range(n_layer))
        return super().random_fields(head_dim, n_head, n_head_kv, n_layer, False) | {
            "ssm_conv": 4, "ssm_state": head_dim, "ssm_k_heads": n_head, "ssm_v_heads": n_head, "layer_kinds": kinds,
            "n_head_kv_layers": tuple(0 if c == "r" else 1 for c in kinds),
        }
