"""The gated delta-net hybrid (qwen3next / qwen35moe): keys, tensors, writer and random fields of its layers.

Recurrent layers are gated delta-net linear attention (numerics in :mod:`experts.delta_net`), the others full
attention with a fused Q+gate projection (per head ``[q, gate]``) whose sigmoid gates the attention output; the five
``ssm.*`` keys are required.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import gguf

from ..arch import QKNorm
from ..errors import ModelFormatError
from .attention import Attention, Shapes
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig

SSM_KEYS = ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")
RANDOM_ATTN_INTERVAL = 2  # random models: full attention every 2nd layer, so 3 layers hold both kinds


@dataclass(frozen=True)
class GatedDeltaNet(Attention):
    """Recurrent layers (``cfg.layer_kinds``) of gated delta-net, full layers of gated attention."""

    qk_norm: QKNorm = QKNorm.PER_HEAD  # full-attention layers only
    tiled_v: bool = False  # V heads stored tiled (v head j reads k head j % n_k), not grouped (j // (n_v / n_k))
    split_ba: bool = False  # ssm_beta + ssm_alpha (n_v, n_embd) each, not one ssm_ba of per-k-head [beta, alpha] rows
    ssm_in: bool = False  # a legacy ssm_in (per k head [q, k, v, z]) may replace attn_qkv + attn_gate
    gated_q: ClassVar[bool] = True

    def read(self, k: Keys, head_dim: int, n_layer: int) -> dict:
        """The ssm.* keys as llama.cpp's ``load_arch_hparams`` reads them, and the layer schedule:
        ``attention.recurrent_layers`` if present, else recurrent iff ``(i + 1) % full_attention_interval != 0``
        (default 4)."""
        super().read(k, head_dim, n_layer)
        a = k.prefix
        ssm = {key: int(k.req("ssm." + key)) for key in SSM_KEYS}
        state, n_v, n_k = ssm["state_size"], ssm["time_step_rank"], ssm["group_count"]
        if not (state > 0 and n_k > 0 and n_v % n_k == 0 and ssm["inner_size"] == state * n_v and ssm["conv_kernel"] > 1):
            raise ModelFormatError(f"{a}ssm.* keys {ssm} do not fit a gated delta-net (llama.cpp needs inner_size = state_size * time_step_rank, time_step_rank a multiple of group_count, conv_kernel > 1)")
        flags = k.opt("attention.recurrent_layers", None)
        if flags is not None:
            if not isinstance(flags, list) or len(flags) < n_layer:
                raise ModelFormatError(f"{a}attention.recurrent_layers must be one flag per layer ({n_layer} at least)")
            kinds = "".join("r" if f else "a" for f in flags[:n_layer])
        else:
            interval = int(k.opt("full_attention_interval", 4))
            if interval < 1:
                raise ModelFormatError(f"{a}full_attention_interval is {interval}; it must be at least 1")
            kinds = "".join("r" if (i + 1) % interval else "a" for i in range(n_layer))
        return {"ssm_conv": ssm["conv_kernel"], "ssm_state": state, "ssm_k_heads": n_k, "ssm_v_heads": n_v, "layer_kinds": kinds}

    def shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        if cfg.is_recurrent(i):
            return self.recurrent_shapes(cfg, b)
        d = cfg.n_embd  # gated full attention: per head [q, gate] rows
        return {b + "attn_q.weight": (2 * cfg.q_dim, d), b + "attn_k.weight": (cfg.kv_dim, d), b + "attn_v.weight": (cfg.kv_dim, d),
                b + "attn_output.weight": (d, cfg.q_dim)}

    def recurrent_shapes(self, cfg: ModelConfig, b: str) -> Shapes:
        """One recurrent layer's tensors (qwen3next.cpp / qwen35moe.cpp ``load_arch_tensors``), attn_qkv + attn_gate
        (a qwen3next file may carry the legacy ssm_in instead: :func:`ssm_in_shape`)."""
        d, n_v, value = cfg.n_embd, cfg.ssm_v_heads, cfg.gdn_value_dim
        shapes: Shapes = {
            b + "attn_qkv.weight": (cfg.gdn_conv_dim, d),
            b + "attn_gate.weight": (value, d),
            b + "ssm_conv1d.weight": (cfg.gdn_conv_dim, cfg.ssm_conv),
            b + "ssm_dt.bias": (n_v,),
            b + "ssm_a": (n_v,),
        }
        if self.split_ba:
            shapes |= {b + "ssm_beta.weight": (n_v, d), b + "ssm_alpha.weight": (n_v, d)}
        else:
            shapes[b + "ssm_ba.weight"] = (2 * n_v, d)
        return shapes | {b + "ssm_norm.weight": (cfg.ssm_state,), b + "ssm_out.weight": (d, value)}

    def extra_shapes(self, cfg: ModelConfig, i: int, b: str) -> Shapes:
        return {} if cfg.is_recurrent(i) else super().extra_shapes(cfg, i, b)

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        w.add_ssm_conv_kernel(cfg.ssm_conv)
        w.add_ssm_inner_size(cfg.gdn_value_dim)
        w.add_ssm_state_size(cfg.ssm_state)
        w.add_ssm_time_step_rank(cfg.ssm_v_heads)
        w.add_ssm_group_count(cfg.ssm_k_heads)
        interval = cfg.layer_kinds.find("a") + 1
        if interval and cfg.layer_kinds == "".join("r" if (i + 1) % interval else "a" for i in range(cfg.n_layer)):
            w.add_full_attention_interval(interval)
        else:  # any other schedule, MTP blocks never recurrent
            w.add_array(f"{cfg.arch}.attention.recurrent_layers", [k == "r" for k in cfg.layer_kinds] + [False] * cfg.n_nextn)

    def required_keys(self) -> set[str]:
        return {"ssm." + key for key in SSM_KEYS}

    def random_fields(self, head_dim: int, n_head: int, n_head_kv: int, n_layer: int, mla_kv_b: bool) -> dict:
        """S = head_dim, n_v = n_head, n_k = n_v / 2 (so grouped vs tiled V heads matters), conv 4 (Qwen3-Next's kernel)."""
        every = RANDOM_ATTN_INTERVAL
        return {"ssm_conv": 4, "ssm_state": head_dim, "ssm_k_heads": max(1, n_head // 2), "ssm_v_heads": n_head,
                "layer_kinds": "".join("r" if (i + 1) % every else "a" for i in range(n_layer))}


def ssm_in_shape(cfg: ModelConfig) -> tuple[int, int]:
    """The legacy ssm_in: per k head [q, k, v, z] rows (qwen3next's ``qkvz_dim``)."""
    return 2 * cfg.gdn_key_dim + 2 * cfg.gdn_value_dim, cfg.n_embd
