"""Hyper-parameters of a MoE model, as read from (or written to) GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .arch import Activation, Gating
from .moe import OAI_LIMIT, Glu, Router

if TYPE_CHECKING:
    from .archs import Arch

# Fields added after the first digests were published: left out of the config line (and so of the
# model digest) while at their default, so every older model keeps its digest.
_LATER = {"omit_default": True}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int  # layers the forward runs: block_count - nextn_predict_layers
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0  # 0: no shared expert
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    context_length: int = 2048
    name: str = "moeswarm-model"
    n_nextn: int = field(default=0, metadata=_LATER)  # trailing MTP blocks in the file, never run (llama.cpp neither)
    n_dense_lead: int = field(default=0, metadata=_LATER)  # layers 0..n-1 have a dense FFN, no experts
    n_ff_dense: int = field(default=0, metadata=_LATER)  # the dense layers' FFN width (feed_forward_length)
    n_rot: int = field(default=0, metadata=_LATER)  # rotated dims of a head (rope.dimension_count); 0: all of them
    gating: str | None = field(default=None, metadata=_LATER)  # Gating name when the arch reads it from the file
    norm_topk: bool | None = field(default=None, metadata=_LATER)  # when the arch reads expert_weights_norm
    expert_weights_scale: float = field(default=0.0, metadata=_LATER)
    n_expert_groups: int = field(default=0, metadata=_LATER)  # group-limited top-k (DeepSeek-V3 style) when > 1
    n_group_used: int = field(default=0, metadata=_LATER)
    n_swa: int = field(default=0, metadata=_LATER)  # sliding window (attention.sliding_window); 0: every layer attends to all
    swa_period: int = field(default=0, metadata=_LATER)  # llama.cpp's set_swa_pattern(n): layer i is SWA iff i % n < n - 1
    rope_theta_swa: float = field(default=0.0, metadata=_LATER)  # rope.freq_base_swa of SWA layers; 0: rope_theta
    yarn_factor: float = field(default=0.0, metadata=_LATER)  # rope.scaling.factor when rope.scaling.type is yarn; 0: no YaRN
    yarn_orig_ctx: int = field(default=0, metadata=_LATER)  # rope.scaling.original_context_length (YaRN's n_ctx_orig)
    # Multi-head latent attention (experts.archs.mla): head_dim is then the query/key head (qk_nope + qk_rope, the rope part
    # being the n_rot trailing dims), v_head_dim the value head; K and V of every head come from one latent of kv_lora_rank.
    q_lora_rank: int = field(default=0, metadata=_LATER)  # 0: the query is one projection (attn_q, "lite")
    kv_lora_rank: int = field(default=0, metadata=_LATER)
    v_head_dim: int = field(default=0, metadata=_LATER)
    mla_kv_b: bool = field(default=False, metadata=_LATER)  # the legacy layout: one attn_kv_b, not attn_k_b/attn_v_b
    yarn_log_mul: float = field(default=0.0, metadata=_LATER)  # rope.scaling.yarn_log_multiplier / 0.1 (mscale_all_dim)
    moe_step: int = field(default=0, metadata=_LATER)  # interleave_moe_layer_step: layer i has experts iff (i + 1) % step == 0; 0: every layer
    # Gated delta-net (experts.archs.gdn): the ssm.* keys, and one letter per layer, "r" recurrent (linear attention)
    # or "a" full attention (attention.recurrent_layers, or full_attention_interval: recurrent iff (i + 1) % interval).
    ssm_conv: int = field(default=0, metadata=_LATER)  # ssm.conv_kernel: causal conv width (the state keeps conv - 1 inputs)
    ssm_state: int = field(default=0, metadata=_LATER)  # ssm.state_size: the key (and value) head width S
    ssm_k_heads: int = field(default=0, metadata=_LATER)  # ssm.group_count
    ssm_v_heads: int = field(default=0, metadata=_LATER)  # ssm.time_step_rank (ssm.inner_size = S * this)
    layer_kinds: str = field(default="", metadata=_LATER)
    # Per-layer arrays as the file has them (one entry per block, MTP blocks included); (): the scalar everywhere.
    n_head_layers: tuple[int, ...] = field(default=(), metadata=_LATER)  # attention.head_count array; () : n_head
    n_head_kv_layers: tuple[int, ...] = field(default=(), metadata=_LATER)  # attention.head_count_kv array; (): n_head_kv
    swa_pattern: tuple[bool, ...] = field(default=(), metadata=_LATER)  # sliding_window_pattern array; (): swa_period decides
    # SwiGLU clamps (step35's swiglu_clamp_exp / swiglu_clamp_shexp): part of the config line, so they reach a worker in
    # its slice's hyper-parameters and enter the model digest; (): no clamp
    clamp_exp: tuple[float, ...] = field(default=(), metadata=_LATER)
    clamp_shexp: tuple[float, ...] = field(default=(), metadata=_LATER)
    # DeepSeek Sparse Attention's lightning indexer (experts.archs.dsa, deepseek32): its heads, head width, and how
    # many past positions each query's attention keeps; 0 heads: every position attends to all its past
    indexer_heads: int = field(default=0, metadata=_LATER)
    indexer_head_dim: int = field(default=0, metadata=_LATER)
    indexer_top_k: int = field(default=0, metadata=_LATER)
    # MiniMax Sparse Attention (experts.archs.msa, minimax-m3): indexer_top_k then counts blocks of indexer_block_size
    # positions, the indexer_local_blocks latest of which (the query's own included) are always kept; 0: not MSA
    indexer_block_size: int = field(default=0, metadata=_LATER)
    indexer_local_blocks: int = field(default=0, metadata=_LATER)

    def __post_init__(self) -> None:
        for f in ("n_head_layers", "n_head_kv_layers", "swa_pattern", "clamp_exp", "clamp_shexp"):  # a config line has lists
            object.__setattr__(self, f, tuple(getattr(self, f)))

    @property
    def spec(self) -> Arch:
        """The arch's family description (:mod:`experts.archs`, which builds configs: imported here, not at the top)."""
        from .archs import arch_spec

        return arch_spec(self.arch)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.n_rot or self.head_dim

    def heads(self, layer: int) -> int:
        """Query heads of *layer* (llama.cpp's ``hparams.n_head(il)``)."""
        return self.n_head_layers[layer] if self.n_head_layers else self.n_head

    def kv_heads(self, layer: int) -> int:
        return self.n_head_kv_layers[layer] if self.n_head_kv_layers else self.n_head_kv

    def rope_dim_at(self, layer: int) -> int:
        """Rotated dims of a head on *layer* (step35's full-attention layers rotate half: llama.cpp's n_rot_full /= 2)."""
        return self.spec.rope_dim_at(self, layer)

    @property
    def rope_freqs_len(self) -> int:
        """Entries of rope_freqs.weight: half the widest rotation of any layer (llama.cpp's n_rot_max / 2)."""
        return max(self.rope_dim_at(i) for i in range(self.n_layer)) // 2

    def glu_exp(self, layer: int) -> Glu:
        """The routed experts' activation on *layer*: gpt-oss's SwiGLU-OAI (clamped at 7), or SwiGLU with the layer's clamp."""
        if self.spec.experts.act is Activation.SWIGLU_OAI:
            return Glu(Activation.SWIGLU_OAI, OAI_LIMIT)
        return Glu(Activation.SILU, self.clamp_exp[layer] if self.clamp_exp else 0.0)

    def glu_shexp(self, layer: int) -> Glu:
        """The shared expert's and the dense FFN's activation on *layer* (llama.cpp's build_ffn: swiglu_clamp_shexp;
        minimax-m3's SwiGLU-OAI, the arch's ``dense_act``)."""
        if self.spec.dense_act is Activation.SWIGLU_OAI:
            return Glu(Activation.SWIGLU_OAI, OAI_LIMIT)
        return Glu(Activation.SILU, self.clamp_shexp[layer] if self.clamp_shexp else 0.0)

    @property
    def gguf_kv_lengths(self) -> tuple[int, int]:
        """attention.key_length / value_length as llama.cpp reads them: an absorbed MLA file states its one cached
        KV head (latent + rope dims, latent), a legacy one the decompressed heads."""
        if not self.kv_lora_rank:
            return self.head_dim, self.head_dim
        if self.mla_kv_b:
            return self.head_dim, self.v_head_dim
        return self.kv_lora_rank + self.rope_dim, self.kv_lora_rank

    @property
    def kv_cache_floats(self) -> int:
        """Floats the KV cache holds per token per layer: the latent and the roped key part under MLA (576 for
        DeepSeek-V3, in both file layouts; 704 for V3.2 with its indexer key), else a key and a value per KV head (of the widest layer, when step35's
        layers have different KV head counts)."""
        if self.kv_lora_rank:  # deepseek32 adds each position's lightning-indexer key
            return self.kv_lora_rank + self.rope_dim + (self.indexer_head_dim if self.indexer_heads else 0)
        index_key = self.indexer_head_dim if self.indexer_block_size else 0  # minimax-m3's MSA layers: one indexer key per position
        return 2 * self.head_dim * max(self.kv_heads(i) for i in range(self.n_layer)) + index_key

    @property
    def gdn_key_dim(self) -> int:
        return self.ssm_state * self.ssm_k_heads

    @property
    def gdn_value_dim(self) -> int:
        return self.ssm_state * self.ssm_v_heads

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal conv: q, k (n_k heads each) and v (n_v heads), in that order."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_row_floats(self) -> int:
        """Floats a gated delta-net layer caches per position (its conv input, beta and g: experts.delta_net); KDA's
        g has one decay per key dim (experts.kda)."""
        decays = self.ssm_state if self.spec.attention.key_decay else 1
        return self.gdn_conv_dim + self.ssm_v_heads * (1 + decays)

    @property
    def gdn_state_floats(self) -> int:
        """Floats of one checkpoint of a gated delta-net layer's matrix state (n_v heads of S x S)."""
        return self.ssm_v_heads * self.ssm_state * self.ssm_state

    def is_recurrent(self, layer: int) -> bool:
        """Whether *layer* is a gated delta-net layer (MTP blocks past n_layer never are, as in llama.cpp)."""
        return layer < len(self.layer_kinds) and self.layer_kinds[layer] == "r"

    def is_moe(self, layer: int) -> bool:
        """Whether *layer* routes to experts (else it has a dense FFN and nothing to dispatch)."""
        return layer >= self.n_dense_lead and (self.moe_step == 0 or (layer + 1) % self.moe_step == 0)

    def uses_rope(self, layer: int) -> bool:
        """False on the arch's NoPE layers (llama4: every 4th), which rotate nothing and scale q by temperature instead."""
        return self.spec.uses_rope(layer)

    def first_key(self, layer: int, pos: int) -> int:
        """The first position query *pos* attends to on *layer* (llama.cpp's ``is_masked_swa``): 0 on a full layer;
        on an SWA layer the last ``n_swa`` positions, or with chunked attention the start of the query's chunk."""
        return self.spec.window.first_key(self, pos) if self.is_swa(layer) else 0

    def is_swa(self, layer: int) -> bool:
        """Whether *layer* attends only to the last ``n_swa`` positions (llama.cpp's ``hparams.is_swa``)."""
        if self.swa_pattern:
            return self.n_swa > 0 and self.swa_pattern[layer]
        p = self.swa_period
        return self.n_swa > 0 and (p == 0 or layer % p < p - 1)

    def rope_base(self, layer: int) -> float:
        """The RoPE base of *layer*: SWA layers may have their own (``model.get_rope_freq_base``)."""
        return self.rope_theta_swa if self.rope_theta_swa and self.is_swa(layer) else self.rope_theta

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if self.is_moe(i))

    @property
    def router(self) -> Router:
        """The router llama.cpp builds for this model: the arch's fixed choices, or the file's where it reads them."""
        spec = self.spec.router
        gating = Gating[self.gating.upper()] if self.gating else spec.gating
        assert gating is not None, "read_config requires expert_gating_func for this arch"
        return Router(
            gating=gating,
            norm=spec.norm if self.norm_topk is None else self.norm_topk,
            scale=self.expert_weights_scale,
            n_groups=self.n_expert_groups,
            n_group_used=self.n_group_used,
            select_logits=spec.select_on_logits,
        )

    def canonical(self) -> dict:
        """The fields that enter the config line: later fields only when they differ from their default."""
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("omit_default") and out[f.name] == f.default:
                del out[f.name]
        return out


@dataclass(frozen=True)
class TokenizerSpec:
    """The ``tokenizer.ggml.*`` metadata: enough for llama.cpp and for :mod:`experts.tokenizer`."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    bos_id: int | None  # None: no BOS (glm4's pre-types have no default and the file names none)
    eos_id: int
    pre: str = "default"
    scores: list[float] | None = None  # SPM
    merges: list[str] | None = None  # BPE: "a b" per merge, highest priority first
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    extra: dict = field(default_factory=dict)
