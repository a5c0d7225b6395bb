"""Per-architecture facts, kept as one table (as gguf-py keeps its constants).

The math in :mod:`experts.forward` and :mod:`experts.moe` never branches on an
architecture name; it reads the :class:`ArchSpec` of the model instead. Each row
mirrors what llama.cpp hard-codes for that architecture (``src/models/*.cpp``),
not what the model's own config claims: llama.cpp ignores ``norm_topk_prob``, so
we do too, otherwise our logits would not match the reference engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RopeStyle(enum.Enum):
    """How RoPE pairs the dimensions of a head."""

    NORM = "norm"  # adjacent pairs (2i, 2i+1): llama / Mixtral
    NEOX = "neox"  # halves (i, i + d/2): Qwen2-MoE, Qwen3-MoE


class SharedExpert(enum.Enum):
    """Whether a layer adds an always-on shared expert next to the routed ones."""

    NONE = "none"
    SIGMOID_GATED = "sigmoid_gated"  # qwen2moe: shexp(x) * sigmoid(w . x)


@dataclass(frozen=True)
class ArchSpec:
    name: str
    rope: RopeStyle
    norm_topk: bool  # renormalise the top-k softmax weights to sum to 1
    shared_expert: SharedExpert
    qk_norm: bool  # per-head RMSNorm of Q and K before RoPE (qwen3moe)
    qkv_bias: bool  # attention Q/K/V projections carry a bias (qwen2moe)
    tied_output_allowed: bool  # output.weight may be absent and tied to token_embd
    n_ff_exp_key: str  # GGUF key (without the arch prefix) holding the expert FFN width
    requires_rms_eps: bool = True


ARCHS: dict[str, ArchSpec] = {
    "qwen2moe": ArchSpec(
        name="qwen2moe",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.SIGMOID_GATED,
        qk_norm=False,
        qkv_bias=True,
        tied_output_allowed=False,
        n_ff_exp_key="expert_feed_forward_length",
    ),
    "qwen3moe": ArchSpec(
        name="qwen3moe",
        rope=RopeStyle.NEOX,
        norm_topk=True,
        shared_expert=SharedExpert.NONE,
        qk_norm=True,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
    ),
    "llama": ArchSpec(
        name="llama",
        rope=RopeStyle.NORM,
        norm_topk=True,
        shared_expert=SharedExpert.NONE,
        qk_norm=False,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="feed_forward_length",
    ),
}

# Stacked expert tensors: numpy shape (n_expert, rows, cols), i.e. ggml ne[2] = expert.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
FUSED_GATE_UP = "ffn_gate_up_exps"  # (n_expert, 2 * n_ff_exp, n_embd): gate rows first, then up


def arch_spec(name: str) -> ArchSpec:
    """Look up an architecture; the error lists what is supported."""
    from .errors import ModelFormatError

    try:
        return ARCHS[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHS))
        raise ModelFormatError(
            f"unsupported architecture {name!r} (general.architecture); supported: {supported}"
        ) from None
