"""The vocabulary every architecture is described in: RoPE styles, q/k norms, gating functions, activations, and the
names of the stacked expert tensors (as gguf-py keeps its constants).

The architectures themselves are :mod:`experts.archs`, one module per model family. Each mirrors what llama.cpp
hard-codes for the arch (``src/models/*.cpp``), not what the model's own config claims: llama.cpp ignores
``norm_topk_prob``, so we do too, otherwise our logits would not match the reference engine.
"""

from __future__ import annotations

import enum


class RopeStyle(enum.Enum):
    """How RoPE pairs the dimensions of a head."""

    NORM = "norm"  # adjacent pairs (2i, 2i+1): llama / Mixtral
    NEOX = "neox"  # halves (i, i + d/2): Qwen2-MoE, Qwen3-MoE


class QKNorm(enum.Enum):
    """RMSNorm of Q and K before RoPE, and over what."""

    NONE = "none"
    PER_HEAD = "per_head"  # weight (head_dim,), each head normed alone (qwen3moe, glm4moe)
    WHOLE = "whole"  # weight (n_head*head_dim,) / (n_head_kv*head_dim,), the whole projection normed at once (olmoe, minimax-m2)
    WEIGHTLESS_AFTER_ROPE = "weightless_after_rope"  # llama4: per-head RMS norm without weight, after RoPE, RoPE layers only


class Gating(enum.Enum):
    """Router probabilities from logits; values are llama.cpp's ``expert_gating_func`` codes."""

    SOFTMAX = 1
    SIGMOID = 2
    SOFTMAX_WEIGHT = 3  # gpt-oss: select on the raw logits, weights = softmax over the k selected logits


class Activation(enum.Enum):
    """The gated activation inside an expert (llama.cpp's ``llm_ffn_op_type`` of ``build_moe_ffn``)."""

    SILU = "silu"  # silu(gate) * up
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: g = min(gate, 7); g * sigmoid(1.702 g) * (clip(up, -7, 7) + 1)


# Stacked expert tensors: numpy shape (n_expert, rows, cols), i.e. ggml ne[2] = expert.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
EXPERT_BIASES = tuple(k + ".bias" for k in EXPERT_TENSORS)  # (n_expert, rows): one bias row per expert
FUSED_GATE_UP = "ffn_gate_up_exps"  # (n_expert, 2 * n_ff_exp, n_embd): gate rows first, then up
# Tensors an MTP block (blk.N, N >= n_layer) may carry besides its layer and nextn.{eh_proj,enorm,hnorm}.
MTP_OPTIONAL = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight", "nextn.shared_head_norm.weight")

