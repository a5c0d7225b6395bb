"""Grouped-query attention as llama.cpp's builders lay it out, with the options they switch per arch.

An arch's attention owns four things: the keys it reads (:meth:`Attention.read`), its tensors' shapes (split in two
because the random models draw tensors in insertion order: the projections first, the biases and norms after the
FFN, as the first writer did), the keys it writes, and the fields a random model of it gets. MLA
(:mod:`.mla`) and the gated delta-net hybrid (:mod:`.gdn`) are subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import gguf

from ..arch import QKNorm, RopeStyle
from ..errors import ModelFormatError
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Attention:
    """attn_q/k/v (or one fused attn_qkv) and attn_output, RoPE over the first ``n_rot`` dims of each head."""

    rope: RopeStyle = RopeStyle.NEOX
    qk_norm: QKNorm = QKNorm.NONE
    qkv_bias: bool = False  # attn_{q,k,v}.bias
    out_bias: bool = False  # attn_output.bias (gpt-oss; required there)
    sinks: bool = False  # attn_sinks.weight (n_head,): a per-head logit that joins every softmax, unscaled
    fused_qkv: bool = False  # one attn_qkv (q_dim + 2 kv_dim, n_embd); llama.cpp needs q_dim == n_embd
    head_gate: bool = False  # attn_gate.weight (n_head, n_embd): each head's output times sigmoid(its gate . x)
    mha_only: bool = False  # llama.cpp needs n_head_kv == n_head (olmoe: its K norm is n_embd wide)
    rope_freqs: bool = False  # rope_freqs.weight (n_rot/2,), always optional: llama3-style factors dividing each pair's angle
    optional: tuple[str, ...] = ()  # of its per-layer tensors, those llama.cpp loads only if present
    latent: ClassVar[bool] = False  # the forward's MLA path (:class:`.mla.LatentAttention`)
    gated_q: ClassVar[bool] = False  # attn_q holds per head [q, gate] rows (the delta-net hybrids' full layers)
    key_decay: ClassVar[bool] = False  # recurrent layers decay each key dim of the state (KDA), not each head
    needs_flash_attn: ClassVar[bool] = False  # llama.cpp computes it only with flash attention on (MSA: off, it runs dense)

    @property
    def optional_tensors(self) -> tuple[str, ...]:
        return self.optional + (("rope_freqs.weight",) if self.rope_freqs else ())

    def read(self, k: Keys, head_dim: int, n_layer: int) -> dict:
        """Config fields of this attention beyond the common ones (``head_dim`` may be replaced)."""
        if int(k.opt("attention.value_length", head_dim)) != head_dim:
            raise ModelFormatError(f"{k.prefix}attention.value_length differs from the key length {head_dim}; moeswarm's attention needs equal K and V heads")
        return {}

    def check(self, cfg: ModelConfig) -> None:
        """Head layouts llama.cpp cannot run for this arch, refused when a file is opened."""
        if self.fused_qkv and cfg.q_dim != cfg.n_embd:
            raise ModelFormatError(f"{cfg.arch} needs n_head * head_dim == n_embd (llama.cpp sizes attn_qkv by n_embd); got {cfg.q_dim} != {cfg.n_embd}")
        if self.mha_only and cfg.n_head_kv != cfg.n_head:
            raise ModelFormatError(f"{cfg.arch} needs as many KV heads as heads (llama.cpp sizes its K for n_head heads); got {cfg.n_head_kv} of {cfg.n_head}")

    def shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        """Layer *i*'s projections."""
        d = cfg.n_embd
        q_dim, kv_dim = cfg.heads(i) * cfg.head_dim, cfg.kv_heads(i) * cfg.head_dim
        out: Shapes = {}
        if self.fused_qkv:
            out[b + "attn_qkv.weight"] = (q_dim + 2 * kv_dim, d)
        else:
            out |= {b + "attn_q.weight": (q_dim, d), b + "attn_k.weight": (kv_dim, d), b + "attn_v.weight": (kv_dim, d)}
        out[b + "attn_output.weight"] = (d, q_dim)
        if self.head_gate:
            out[b + "attn_gate.weight"] = (cfg.heads(i), d)
        return out

    def extra_shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        """Layer *i*'s biases, sinks and q/k norms."""
        q_dim, kv_dim = cfg.heads(i) * cfg.head_dim, cfg.kv_heads(i) * cfg.head_dim
        out: Shapes = {}
        if self.qkv_bias:
            out |= {b + "attn_q.bias": (q_dim,), b + "attn_k.bias": (kv_dim,), b + "attn_v.bias": (kv_dim,)}
        if self.out_bias:
            out[b + "attn_output.bias"] = (cfg.n_embd,)
        if self.sinks:
            out[b + "attn_sinks.weight"] = (cfg.heads(i),)
        if self.qk_norm is QKNorm.PER_HEAD:
            out |= {b + "attn_q_norm.weight": (cfg.head_dim,), b + "attn_k_norm.weight": (cfg.head_dim,)}
        elif self.qk_norm is QKNorm.WHOLE:
            out |= {b + "attn_q_norm.weight": (q_dim,), b + "attn_k_norm.weight": (kv_dim,)}
        return out

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        """Keys of this attention beyond the common ones (written before any YaRN keys)."""

    def required_keys(self) -> set[str]:
        return set()

    def random_fields(self, head_dim: int, n_head: int, n_head_kv: int, n_layer: int, mla_kv_b: bool) -> dict:
        """A random model's attention fields (``head_dim`` / ``n_head_kv`` may be replaced)."""
        return {}


def imrope_sections(cfg: ModelConfig) -> list[int]:
    """IMROPE's time/height/width split of the rotated pairs in Qwen3-VL's proportions (24/20/20/0 of 64); a text
    forward never sees it (all sections hold the token's position), but llama.cpp requires the key."""
    pairs = cfg.rope_dim // 2
    hw = pairs * 5 // 16
    return [pairs - 2 * hw, hw, hw, 0]
