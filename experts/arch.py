"""Per-architecture facts, kept as one table (as gguf-py keeps its constants).

The math in :mod:`experts.forward` and :mod:`experts.moe` never branches on an
architecture name; it reads the :class:`ArchSpec` of the model instead. Each row
mirrors what llama.cpp hard-codes for that architecture (``src/models/*.cpp``),
not what the model's own config claims: llama.cpp ignores ``norm_topk_prob``, so
we do too, otherwise our logits would not match the reference engine. Where llama.cpp
reads a router setting from the file instead (``*_from_file``), :func:`experts.gguf_model.read_config`
reads it into the :class:`experts.config.ModelConfig`.
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
    PLAIN = "plain"  # glm4moe: shexp(x), added as is


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


@dataclass(frozen=True)
class ArchSpec:
    name: str
    rope: RopeStyle
    norm_topk: bool  # renormalise the top-k weights to sum to 1 (default when norm_from_file finds no key)
    shared_expert: SharedExpert
    qk_norm: QKNorm
    qkv_bias: bool  # attention Q/K/V projections carry a bias (qwen2moe)
    tied_output_allowed: bool  # output.weight may be absent and tied to token_embd
    n_ff_exp_key: str  # GGUF key (without the arch prefix) holding the expert FFN width
    requires_rms_eps: bool = True
    gating: Gating | None = Gating.SOFTMAX  # default gating; None: the file must name it (expert_gating_func)
    gating_from_file: bool = False  # llama.cpp reads expert_gating_func for this arch
    norm_from_file: bool = False  # ... expert_weights_norm
    scale_from_file: bool = False  # ... expert_weights_scale (routed weights multiplied by it unless 0 or 1)
    selection_bias: bool = False  # blk.N.exp_probs_b.bias (required): added to the probabilities for top-k selection only
    dense_lead: bool = False  # leading_dense_block_count layers have a plain FFN (ffn_gate/up/down) instead of experts
    shexp_from_count: bool = False  # shared width = expert width * expert_shared_count (else expert_shared_feed_forward_length)
    ffn_norm: str = "ffn_norm"  # the FFN pre-norm tensor (glm4moe calls it post_attention_norm)
    optional_tensors: tuple[str, ...] = ()  # per-layer tensors llama.cpp loads if present (random models write them)
    mha_only: bool = False  # llama.cpp needs n_head_kv == n_head (olmoe: its K norm is n_embd wide)
    router_bias: bool = False  # blk.N.ffn_gate_inp.bias: added to the router logits (gpt-oss)
    expert_act: Activation = Activation.SILU
    expert_bias: bool = False  # ffn_{gate,up,down}_exps.bias: per-expert biases, sliced and proven like the weights
    attn_out_bias: bool = False  # attn_output.bias (gpt-oss; required there)
    attn_sinks: bool = False  # attn_sinks.weight (n_head,): a per-head logit that joins every softmax, unscaled
    swa_period: int = 0  # > 0: attention.sliding_window is required; default period of the SWA layer pattern
    # GGUF keys (without the arch prefix) llama.cpp refuses a file without but whose value changes nothing in a
    # text forward, each with the one value llama.cpp's graph can run (None: any; the writer's in model_writer)
    fixed_keys: tuple[tuple[str, int | None], ...] = ()
    shexp_key_only: bool = False  # a shared expert iff expert_shared_feed_forward_length > 0 (no feed_forward_length fallback)
    shexp_unit_key: bool = False  # with shexp_from_count: the unit is expert_shared_feed_forward_length when set (bailingmoe2)
    mtp_norms: tuple[str, ...] = ()  # (n_embd,) norms an MTP block must carry besides nextn.{eh_proj,enorm,hnorm}
    fused_qkv: bool = False  # one attn_qkv (q_dim + 2 kv_dim, n_embd) instead of attn_q/k/v; llama.cpp needs q_dim == n_embd
    mla: bool = False  # multi-head latent attention (deepseek2): q-LoRA, a shared latent KV, YaRN mscale² in the scale
    # llama4 (src/models/llama4.cpp, llama-graph.cpp build_moe_ffn):
    select_on_logits: bool = False  # top-k on the raw router logits (the weights are still the gated probabilities)
    weight_before_expert: bool = False  # y_j = expert_j(w_j x), not w_j expert_j(x)
    interleave_moe: bool = False  # interleave_moe_layer_step (required): layer i has experts iff (i + 1) % step == 0
    shexp_expert_width: bool = False  # the shared expert is as wide as a routed one (llama.cpp: n_ff_shexp = n_ff_exp)
    rope_freqs: bool = False  # optional rope_freqs.weight (n_rot/2,): llama3-style factors, each pair's angle divided by its
    chunked_attn: int = 0  # > 0: SWA layers attend within fixed chunks of this many positions (llama.cpp hard-codes 8192)
    chunk_period: int = 0  # default SWA pattern of chunked attention (sliding_window_pattern overrides)
    nope_period: int = 0  # > 0: layer i has no RoPE (and no q/k norm) iff (i + 1) % nope_period == 0
    attn_temp: tuple[float, float, float] | None = None  # NoPE layers scale q by log(floor((pos + offset) / floor_) + 1) * scale + 1: (floor_, scale, offset)
    kq_norm_off_at: int = 0  # no q/k norm for models with this many experts (llama.cpp: use_kq_norm false for 17B_128E)
    # qwen3next / qwen35moe (src/models/qwen3next.cpp, qwen35moe.cpp, delta-net-base.cpp): recurrent layers are gated
    # delta-net linear attention (experts/delta_net.py), the others full attention with a fused Q+gate projection (per
    # head [q, gate]) whose sigmoid gates the attention output; the ssm.* keys are required.
    delta_net: bool = False
    gdn_tiled_v: bool = False  # V heads stored tiled (v head j reads k head j % n_k), not grouped (j // (n_v / n_k))
    gdn_split_ba: bool = False  # ssm_beta + ssm_alpha (n_v, n_embd) each, not one ssm_ba of per-k-head [beta, alpha] rows
    gdn_ssm_in: bool = False  # a legacy ssm_in (per k head [q, k, v, z]) may replace attn_qkv + attn_gate
    # step35 (src/models/step35.cpp):
    layer_heads: bool = False  # attention.head_count / head_count_kv may be per-layer arrays of different counts
    swa_layers: bool = False  # attention.sliding_window and a per-layer sliding_window_pattern bool array are required
    half_rot_full: bool = False  # full-attention layers rotate half of rope.dimension_count, SWA layers all of it
    rope_freqs_swa: bool = True  # rope_freqs factors apply on SWA layers too (step35: full-attention layers only)
    swa_rope_base: float = 0.0  # SWA layers' RoPE base when the file has no rope.freq_base_swa; 0: rope.freq_base
    head_gate: bool = False  # optional attn_gate.weight (n_head, n_embd): each head's output times sigmoid(its gate . x)
    swiglu_clamps: bool = False  # per-layer swiglu_clamp_exp (routed experts) / swiglu_clamp_shexp (shared, dense FFNs)


ARCHS: dict[str, ArchSpec] = {
    "qwen2moe": ArchSpec(
        name="qwen2moe",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.SIGMOID_GATED,
        qk_norm=QKNorm.NONE,
        qkv_bias=True,
        tied_output_allowed=False,
        n_ff_exp_key="expert_feed_forward_length",
    ),
    "qwen3moe": ArchSpec(
        name="qwen3moe",
        rope=RopeStyle.NEOX,
        norm_topk=True,
        shared_expert=SharedExpert.NONE,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
    ),
    "llama": ArchSpec(
        name="llama",
        rope=RopeStyle.NORM,
        norm_topk=True,
        shared_expert=SharedExpert.NONE,
        qk_norm=QKNorm.NONE,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="feed_forward_length",
    ),
    # src/models/olmoe.cpp: whole-vector q/k norm (K's is n_embd wide), softmax without renorm.
    "olmoe": ArchSpec(
        name="olmoe",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.NONE,
        qk_norm=QKNorm.WHOLE,
        qkv_bias=False,
        tied_output_allowed=False,
        n_ff_exp_key="feed_forward_length",
        mha_only=True,
    ),
    # src/models/glm4-moe.cpp: sigmoid + selection bias, router norm/scale from the file, leading dense
    # layers, plain shared expert, FFN pre-norm named post_attention_norm, optional biases and q/k norm.
    "glm4moe": ArchSpec(
        name="glm4moe",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=True,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        gating=Gating.SIGMOID,
        gating_from_file=True,
        norm_from_file=True,
        scale_from_file=True,
        selection_bias=True,
        dense_lead=True,
        shexp_from_count=True,
        ffn_norm="post_attention_norm",
        optional_tensors=("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight", "attn_k_norm.weight"),
    ),
    # src/models/minimax-m2.cpp: whole-vector q/k norm, gating named by the file, renorm hard-coded, no scale.
    "minimax-m2": ArchSpec(
        name="minimax-m2",
        rope=RopeStyle.NEOX,
        norm_topk=True,
        shared_expert=SharedExpert.NONE,
        qk_norm=QKNorm.WHOLE,
        qkv_bias=False,
        tied_output_allowed=False,
        n_ff_exp_key="feed_forward_length",
        gating=None,
        gating_from_file=True,
        selection_bias=True,
        fixed_keys=(("expert_feed_forward_length", None),),  # required by its loader, which shapes experts with n_ff
    ),
    # src/models/openai-moe.cpp: attention with q/k/v/o biases, per-head sinks, sliding window on even layers
    # (period 2 unless the file says), YaRN; router bias, top-k on logits then softmax over the selected;
    # SwiGLU-OAI experts with biases.
    "gpt-oss": ArchSpec(
        name="gpt-oss",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.NONE,
        qk_norm=QKNorm.NONE,
        qkv_bias=True,
        tied_output_allowed=False,
        n_ff_exp_key="expert_feed_forward_length",
        gating=Gating.SOFTMAX_WEIGHT,
        ffn_norm="post_attention_norm",
        router_bias=True,
        expert_act=Activation.SWIGLU_OAI,
        expert_bias=True,
        attn_out_bias=True,
        attn_sinks=True,
        swa_period=2,
    ),
    # src/models/qwen3vlmoe.cpp: qwen3moe's graph with IMROPE, which rotates as NEOX when every section holds the
    # token's position (a text batch); rope.dimension_sections is required. Deepstack only adds the zero padding of
    # text embeddings. Qwen3-VL-30B-A3B / 235B-A22B, text part.
    "qwen3vlmoe": ArchSpec(
        name="qwen3vlmoe",
        rope=RopeStyle.NEOX,
        norm_topk=True,
        shared_expert=SharedExpert.NONE,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        fixed_keys=(("rope.dimension_sections", None),),
    ),
    # src/models/dots1.cpp (rednote dots.llm1): qwen3-style attention with K/V sized for n_head heads, DeepSeek-V3's
    # router from the file (gating required in practice: none aborts build_moe_ffn), optional selection bias,
    # leading dense layers, plain shared expert of expert_shared_count widths, untied output.
    "dots1": ArchSpec(
        name="dots1",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=False,
        n_ff_exp_key="expert_feed_forward_length",
        gating=None,
        gating_from_file=True,
        norm_from_file=True,
        scale_from_file=True,
        selection_bias=True,
        dense_lead=True,
        shexp_from_count=True,
        optional_tensors=("exp_probs_b.bias",),
        mha_only=True,
    ),
    # src/models/ernie4-5-moe.cpp + ernie4-5.cpp (ERNIE-4.5 MoE): NORM RoPE, softmax with an optional selection
    # bias, renorm hard-coded, no scale (expert_weights_scale is not read), leading dense layers, a plain shared
    # expert only if expert_shared_feed_forward_length says so. interleave_moe_layer_step is required and must be 1:
    # llama.cpp loads experts on every layer past the dense lead but would run them only on every step-th.
    "ernie4_5-moe": ArchSpec(
        name="ernie4_5-moe",
        rope=RopeStyle.NORM,
        norm_topk=True,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.NONE,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        selection_bias=True,
        dense_lead=True,
        optional_tensors=("exp_probs_b.bias",),
        fixed_keys=(("interleave_moe_layer_step", 1),),
        shexp_key_only=True,
    ),
    # src/models/bailingmoe2.cpp (Ling / Ring 2.0): fused attn_qkv, per-head q/k norm, partial NEOX RoPE, DeepSeek-V3's
    # router from the file (expert_gating_func required), optional selection bias, leading dense layers, plain shared
    # expert of expert_shared_count units, untied output; MTP blocks (with a layer_output_norm) are never run.
    "bailingmoe2": ArchSpec(
        name="bailingmoe2",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=False,
        n_ff_exp_key="expert_feed_forward_length",
        gating=None,
        gating_from_file=True,
        norm_from_file=True,
        scale_from_file=True,
        selection_bias=True,
        dense_lead=True,
        shexp_from_count=True,
        optional_tensors=("exp_probs_b.bias",),
        shexp_unit_key=True,
        fused_qkv=True,
        mtp_norms=("layer_output_norm.weight",),
    ),
    # src/models/deepseek2.cpp: MLA (absorbed attn_k_b/attn_v_b, or legacy attn_kv_b) with q-LoRA and NORM RoPE,
    # YaRN's mscale² in the attention scale; router gating/norm/scale/groups from the file with an optional selection
    # bias; leading dense layers; a plain shared expert of expert_shared_count expert widths.
    "deepseek2": ArchSpec(
        name="deepseek2",
        rope=RopeStyle.NORM,
        norm_topk=False,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.NONE,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        gating=Gating.SOFTMAX,
        gating_from_file=True,
        norm_from_file=True,
        scale_from_file=True,
        selection_bias=True,
        dense_lead=True,
        shexp_from_count=True,
        optional_tensors=("exp_probs_b.bias",),
        mla=True,
    ),
    # src/models/llama4.cpp: sigmoid top-1 on the raw logits with the weight multiplied into the expert's input,
    # un-gated shared expert as wide as a routed one, MoE every interleave_moe_layer_step-th layer (dense FFN between),
    # NORM RoPE with llama3 frequency factors, chunked attention (8192) on 3 of 4 layers, NoPE every 4th layer with
    # temperature-scaled queries, weightless q/k RMS norm after RoPE (not for 128-expert models).
    "llama4": ArchSpec(
        name="llama4",
        rope=RopeStyle.NORM,
        norm_topk=False,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.WEIGHTLESS_AFTER_ROPE,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        gating=Gating.SIGMOID,
        select_on_logits=True,
        weight_before_expert=True,
        interleave_moe=True,
        shexp_expert_width=True,
        rope_freqs=True,
        chunked_attn=8192,
        chunk_period=4,
        nope_period=4,
        attn_temp=(8192.0, 0.1, 1.0),
        kq_norm_off_at=128,
        optional_tensors=("rope_freqs.weight",),
    ),
    # src/models/qwen3next.cpp (Qwen3-Next-80B-A3B): gated delta-net on 3 of 4 layers, gated full attention with
    # per-head q/k norm and partial NEOX RoPE on the others; softmax router with renorm hard-coded, sigmoid-gated shared
    # expert; the FFN pre-norm is post_attention_norm; an MTP block counted in block_count is never run.
    "qwen3next": ArchSpec(
        name="qwen3next",
        rope=RopeStyle.NEOX,
        norm_topk=True,
        shared_expert=SharedExpert.SIGMOID_GATED,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        ffn_norm="post_attention_norm",
        delta_net=True,
        gdn_ssm_in=True,
    ),
    # src/models/qwen35moe.cpp (Qwen3.5-35B-A3B / 122B-A10B / 397B-A17B, Qwen3.6 MoE): qwen3next with separate
    # ssm_beta / ssm_alpha, tiled V heads, no legacy ssm_in, and IMROPE (NEOX for text positions: the sections key is
    # required but changes nothing in a text forward).
    "qwen35moe": ArchSpec(
        name="qwen35moe",
        rope=RopeStyle.NEOX,
        norm_topk=True,
        shared_expert=SharedExpert.SIGMOID_GATED,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=True,
        n_ff_exp_key="expert_feed_forward_length",
        ffn_norm="post_attention_norm",
        fixed_keys=(("rope.dimension_sections", None),),
        delta_net=True,
        gdn_tiled_v=True,
        gdn_split_ba=True,
    ),
    # src/models/step35.cpp (Step-3.5-Flash / Step-3.7-Flash): per-layer head counts and SWA flags, full-attention
    # layers rotating half the RoPE dims with llama3 rope_freqs and SWA layers all of them with their own base, optional
    # per-head q/k norm, a per-head sigmoid output gate; DeepSeek-V3's router from the file (sigmoid by default) with an
    # optional selection bias, leading dense layers, a plain shared expert, per-layer SwiGLU clamps; MTP blocks never run.
    "step35": ArchSpec(
        name="step35",
        rope=RopeStyle.NEOX,
        norm_topk=False,
        shared_expert=SharedExpert.PLAIN,
        qk_norm=QKNorm.PER_HEAD,
        qkv_bias=False,
        tied_output_allowed=False,
        n_ff_exp_key="expert_feed_forward_length",
        gating=Gating.SIGMOID,
        gating_from_file=True,
        norm_from_file=True,
        scale_from_file=True,
        selection_bias=True,
        dense_lead=True,
        shexp_key_only=True,
        rope_freqs=True,
        optional_tensors=("exp_probs_b.bias", "attn_q_norm.weight", "attn_k_norm.weight", "attn_gate.weight", "rope_freqs.weight"),
        layer_heads=True,
        swa_layers=True,
        half_rot_full=True,
        rope_freqs_swa=False,
        swa_rope_base=10000.0,
        head_gate=True,
        swiglu_clamps=True,
    ),
}

# Stacked expert tensors: numpy shape (n_expert, rows, cols), i.e. ggml ne[2] = expert.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
EXPERT_BIASES = tuple(k + ".bias" for k in EXPERT_TENSORS)  # (n_expert, rows): one bias row per expert
FUSED_GATE_UP = "ffn_gate_up_exps"  # (n_expert, 2 * n_ff_exp, n_embd): gate rows first, then up
# Tensors an MTP block (blk.N, N >= n_layer) may carry besides its layer and nextn.{eh_proj,enorm,hnorm}.
MTP_OPTIONAL = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight", "nextn.shared_head_norm.weight")


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
