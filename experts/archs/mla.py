"""Multi-head latent attention (deepseek2 and the archs built on it): keys, tensors, writer, random fields.

Every head's key and value are linear in one shared latent of ``kv_lora_rank`` floats; the numerics are
:class:`experts.forward.MLA`. Two file layouts: absorbed (``attn_k_b`` / ``attn_v_b``, both ``*_mla`` lengths in the
file, ``key_length`` = latent + rope) and legacy (``attn_kv_b``, ``key_length`` = the query/key head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import gguf
import numpy as np

from ..arch import RopeStyle
from ..errors import ModelFormatError
from .attention import Attention, Shapes
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig


@dataclass(frozen=True)
class LatentAttention(Attention):
    """deepseek2's MLA with q-LoRA (``attn_q_a`` / ``attn_q_b``) or one ``attn_q`` ("lite"), NORM RoPE on the trailing
    ``n_rot`` dims of the query/key head, YaRN's mscale² in the attention scale."""

    rope: RopeStyle = RopeStyle.NORM
    random_ranks: tuple[int, int] = (3, 2)  # a random model's q-LoRA and latent ranks, in multiples of qk_nope
    latent: ClassVar[bool] = True

    def read(self, k: Keys, head_dim: int, n_layer: int) -> dict:
        if float(k.opt("attention.temperature_scale", 0.0)):
            raise ModelFormatError(f"{k.prefix}attention.temperature_scale is set (Q temperature tuning, Mistral-Large style); moeswarm does not implement it")
        k_mla, v_mla = int(k.opt("attention.key_length_mla", 0)), int(k.opt("attention.value_length_mla", 0))
        kv_b = not (k_mla and v_mla)
        head_dim = head_dim if kv_b else k_mla
        return {
            "head_dim": head_dim,
            "q_lora_rank": int(k.opt("attention.q_lora_rank", 0)),
            "kv_lora_rank": int(k.req("attention.kv_lora_rank")),
            "v_head_dim": int(k.opt("attention.value_length", head_dim)) if kv_b else v_mla,
            "mla_kv_b": kv_b,
            # the converter wrote 0.1 * mscale_all_dim; divided in float32 as llama.cpp does (0.1f / 0.1f is exactly 1)
            "yarn_log_mul": float(np.float32(k.opt("rope.scaling.yarn_log_multiplier", 0.0)) / np.float32(0.1)),
        }

    def shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        """One layer's attention tensors (src/models/deepseek2.cpp ``load_arch_tensors``)."""
        d, n, lat, rope, v = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim, cfg.v_head_dim
        nope = cfg.head_dim - rope
        shapes: Shapes = {
            b + "attn_kv_a_mqa.weight": (lat + rope, d),
            b + "attn_kv_a_norm.weight": (lat,),
            b + "attn_output.weight": (d, n * v),
        }
        if cfg.q_lora_rank:
            r = cfg.q_lora_rank
            shapes |= {b + "attn_q_a.weight": (r, d), b + "attn_q_a_norm.weight": (r,), b + "attn_q_b.weight": (cfg.q_dim, r)}
        else:
            shapes[b + "attn_q.weight"] = (cfg.q_dim, d)
        if cfg.mla_kv_b:
            shapes[b + "attn_kv_b.weight"] = (n * (nope + v), lat)  # per head: k_nope rows, then v rows
        else:
            shapes |= {b + "attn_k_b.weight": (n, lat, nope), b + "attn_v_b.weight": (n, v, lat)}
        return shapes

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        if not cfg.mla_kv_b:
            w.add_key_length_mla(cfg.head_dim)
            w.add_value_length_mla(cfg.v_head_dim)
        if cfg.yarn_log_mul:
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg.yarn_log_mul)

    def required_keys(self) -> set[str]:
        return {"attention.kv_lora_rank"}

    def random_fields(self, head_dim: int, n_head: int, n_head_kv: int, n_layer: int, mla_kv_b: bool) -> dict:
        """*head_dim* is the un-roped query/key part (qk_nope, also the value head), the rope part half of it (V3's
        proportions); the absorbed layout caches one latent "head"."""
        q_mul, kv_mul = self.random_ranks
        nope, rope = head_dim, head_dim // 2
        return {"q_lora_rank": q_mul * nope, "kv_lora_rank": kv_mul * nope, "v_head_dim": nope, "mla_kv_b": mla_kv_b,
                "head_dim": nope + rope, "n_head_kv": n_head if mla_kv_b else 1}
