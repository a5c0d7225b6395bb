"""What an architecture is: :class:`Arch`, composed of mechanism parts, with the generic llama.cpp MoE reading,
tensor shapes, writer and random model; a family module subclasses it where its arch has quirks.

The order of tensors in :meth:`Arch.shapes` and of keys in :meth:`Arch.add_hparams` is the order random models draw
and write them in: it is kept as the first writer had it, so every random model (and its digest) stays the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import gguf
import numpy as np

from ..arch import Activation
from ..errors import ModelFormatError
from .attention import Attention, Shapes
from .ffn import ALL_MOE, NO_SHARED, Experts, Schedule, SharedExpert
from .keys import Keys
from .router import RouterSpec
from .window import NO_WINDOW, Window

if TYPE_CHECKING:
    from ..config import ModelConfig

COMMON_KEYS = frozenset({"context_length", "embedding_length", "block_count", "attention.head_count", "expert_count",
                         "expert_used_count", "attention.layer_norm_rms_epsilon"})


@dataclass(frozen=True)
class FixedKey:
    """A key llama.cpp refuses a file without but whose value changes nothing in a text forward: *only* is the one
    value its graph runs correctly (None: any), *value* what the writer stores (neither: another part writes it)."""

    key: str
    only: int | None = None
    value: Callable[[ModelConfig], list[int]] | None = None

    def check(self, k: Keys) -> None:
        got = k.req(self.key)
        if self.only is not None and got != self.only:
            raise ModelFormatError(f"{k.prefix}{self.key} is {got}; {k.arch} runs only with {self.only} (the one value llama.cpp's {k.arch} graph computes correctly)")

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if self.value is not None:
            w.add_array(f"{cfg.arch}.{self.key}", self.value(cfg))
        elif self.only is not None:
            w.add_uint32(f"{cfg.arch}.{self.key}", self.only)


@dataclass(frozen=True)
class RandomFeatures:
    """What a random model of the arch switches on beyond its defaults, so every feature llama.cpp implements for
    the arch is exercised (``moeswarm model random``, the test models)."""

    n_dense_lead: int = 0
    n_nextn: int = 0  # a trailing MTP block
    rot_div: int = 1  # rotate head_dim // rot_div dims (1: the whole head)
    gating: str | None = None  # written as expert_gating_func (archs that read it)
    norm_topk: bool | None = None
    scale: float = 0.0
    groups: tuple[int, int] = (0, 0)  # expert groups / used groups, when the expert count allows them
    n_swa: int = 0
    rope_theta_swa: float = 0.0
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_log_mul: float = 0.0
    moe_step: int = 0


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture (``general.architecture``) as llama.cpp's ``src/models/<arch>.cpp`` builds it."""

    name: str
    attention: Attention = field(default_factory=Attention)
    router: RouterSpec = field(default_factory=RouterSpec)
    experts: Experts = field(default_factory=Experts)
    shared: SharedExpert = NO_SHARED
    schedule: Schedule = ALL_MOE
    window: Window = NO_WINDOW
    dense_act: Activation = Activation.SILU  # the shared expert's and dense FFN's (build_ffn's) activation: minimax-m3's is SwiGLU-OAI too
    ffn_norm: str = "ffn_norm"  # the FFN pre-norm tensor (glm4moe, gpt-oss, qwen3next call it post_attention_norm)
    tied_output: bool = True  # output.weight may be absent and tied to token_embd
    mtp_norms: tuple[str, ...] = ()  # (n_embd,) norms an MTP block must carry besides nextn.{eh_proj,enorm,hnorm}
    fixed_keys: tuple[FixedKey, ...] = ()
    random: RandomFeatures = RandomFeatures()
    per_layer_heads: ClassVar[bool] = False  # attention.head_count / head_count_kv may differ between layers
    attn_temp: ClassVar[tuple[float, float, float] | None] = None  # NoPE layers' query temperature (llama4)

    # ---- reading a file ------------------------------------------------------------------------------------------

    def read(self, k: Keys) -> dict:
        """The fields of :class:`experts.config.ModelConfig` for the file behind *k*, as llama.cpp's loader reads
        them; a file it refuses (or that moeswarm cannot run) raises ModelFormatError naming the key."""
        n_embd = int(k.req("embedding_length"))
        n_nextn = int(k.opt("nextn_predict_layers", 0))
        n_all = int(k.req("block_count"))
        n_layer = n_all - n_nextn  # llama.cpp never runs the MTP blocks
        fields = self.read_heads(k, n_all)
        n_expert = int(k.opt("expert_count", 0))
        if n_expert == 0:
            raise ModelFormatError(f"{k.prefix}expert_count is missing or 0: this is a dense model, not a Mixture-of-Experts one")
        n_ff_exp = k.one(self.experts.width_key)
        n_ff_shexp = self.shared.read(k, n_ff_exp)
        fields |= self.schedule.read(k, n_layer)
        has_dense = fields.get("n_dense_lead", 0) > 0 or fields.get("moe_step", 0) > 1
        head_dim = int(k.opt("attention.key_length", n_embd // fields["n_head"]))
        fields |= self.attention.read(k, head_dim, n_layer)
        head_dim = fields.setdefault("head_dim", head_dim)
        n_rot = int(k.opt("rope.dimension_count", head_dim))
        for key, same in (("attention.key_length_swa", head_dim), ("attention.value_length_swa", head_dim), ("rope.dimension_count_swa", n_rot)):
            if int(k.opt(key, same)) != same:  # llama.cpp's loader reads them for every arch
                raise ModelFormatError(f"{k.prefix}{key} is {k.opt(key, same)}, not {same}: other head or RoPE sizes on SWA layers are not supported")
        fields |= self.router.read(k, n_expert)
        fields |= self.window.read(k, n_all)
        for fixed in self.fixed_keys:
            fixed.check(k)
        scaling = str(k.opt("rope.scaling.type", "none"))
        if scaling not in ("none", "yarn"):
            raise ModelFormatError(f"{k.prefix}rope.scaling.type is {scaling!r}; supported: none, yarn")
        yarn = scaling == "yarn"
        n_ctx = int(k.req("context_length"))  # llama.cpp refuses a file without it
        tokens = k.reader.fields.get("tokenizer.ggml.tokens")
        fields.update(
            n_vocab=len(tokens.data) if tokens is not None else int(k.req("vocab_size")),  # slices keep no vocabulary
            n_embd=n_embd,
            n_layer=n_layer,
            n_expert=n_expert,
            n_expert_used=int(k.req("expert_used_count")),
            n_ff_exp=n_ff_exp,
            n_ff_shexp=n_ff_shexp,
            rms_eps=float(k.req("attention.layer_norm_rms_epsilon")),
            rope_theta=float(k.opt("rope.freq_base", 10000.0)),
            context_length=n_ctx,
            name=str(k.general("general.name", k.arch)),
            n_nextn=n_nextn,
            n_ff_dense=k.one("feed_forward_length") if has_dense else 0,
            n_rot=0 if n_rot == head_dim else n_rot,
            rope_theta_swa=float(k.opt("rope.freq_base_swa", self.window.rope_base)) if fields.get("n_swa") else 0.0,
            yarn_factor=float(k.opt("rope.scaling.factor", 0.0)) if yarn else 0.0,  # absent: factor 1, YaRN changes nothing
            yarn_orig_ctx=int(k.opt("rope.scaling.original_context_length", n_ctx)) if yarn else 0,
        )
        return fields | self.read_extra(k, n_all)

    def read_heads(self, k: Keys, n_all: int) -> dict:
        """attention.head_count / head_count_kv, a number or one per block (llama.cpp's get_key_or_arr, which needs
        exactly block_count entries; the KV count defaults to the head count). An array of one count reads as that
        count, so such files keep their digests; other arrays only where :attr:`per_layer_heads`."""
        heads = k.req("attention.head_count")
        kv = k.opt("attention.head_count_kv", heads)
        out: dict = {}
        for value, key, name in ((heads, "attention.head_count", "n_head"), (kv, "attention.head_count_kv", "n_head_kv")):
            if isinstance(value, list) and len(value) != n_all:
                raise ModelFormatError(f"{k.prefix}{key} has {len(value)} entries; llama.cpp needs one per block ({n_all})")
            counts = tuple(int(x) for x in (value if isinstance(value, list) else [value]))
            if 0 in counts:
                raise ModelFormatError(f"{k.prefix}{key} is 0 on some layer: attention-free layers are not supported")
            out[name] = counts[0]
            if len(set(counts)) > 1:
                if not self.per_layer_heads:
                    raise ModelFormatError(f"{k.prefix}{key} differs between layers; {k.arch} runs one head count on every layer")
                out[name + "_layers"] = counts
        return out

    def read_extra(self, k: Keys, n_all: int) -> dict:
        """Config fields only this arch has (read last)."""
        return {}

    def check(self, cfg: ModelConfig) -> None:
        """Shapes of a read config llama.cpp cannot run for this arch."""
        self.attention.check(cfg)

    def required_keys(self) -> set[str]:
        """The arch keys (without the prefix) llama.cpp refuses any file without, whatever its shape."""
        parts = (self.shared, self.router, self.window, self.attention, self.schedule)
        return set(COMMON_KEYS) | {self.experts.width_key} | {f.key for f in self.fixed_keys} | set().union(*(p.required_keys() for p in parts))

    @property
    def optional_tensors(self) -> tuple[str, ...]:
        """Per-layer tensors (and rope_freqs) llama.cpp loads if present; random models write them."""
        return self.attention.optional_tensors + self.router.optional_tensors

    # ---- tensors -------------------------------------------------------------------------------------------------

    def shapes(self, cfg: ModelConfig) -> Shapes:
        """Numpy shapes (ggml ne reversed) of every tensor llama.cpp loads for *cfg* (optional ones included).

        MoE layers carry the router and the stacked experts, dense layers (``cfg.is_moe`` false) a plain FFN;
        trailing MTP blocks (``n_nextn``) are MoE layers plus their ``nextn.*`` tensors.
        """
        d = cfg.n_embd
        shapes: Shapes = {"token_embd.weight": (cfg.n_vocab, d), "output_norm.weight": (d,), "output.weight": (cfg.n_vocab, d)}
        if self.attention.rope_freqs:
            shapes["rope_freqs.weight"] = (cfg.rope_freqs_len,)
        for i in range(cfg.n_layer + cfg.n_nextn):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = (d,)
            shapes |= self.attention.shapes(cfg, i, b)
            shapes[b + self.ffn_norm + ".weight"] = (d,)
            if cfg.is_moe(i):
                shapes[b + "ffn_gate_inp.weight"] = (cfg.n_expert, d)
                shapes |= self.experts.shapes(cfg, b) | self.router.shapes(cfg, b) | self.experts.bias_shapes(cfg, b)
            else:
                f = cfg.n_ff_dense
                shapes |= {b + "ffn_gate.weight": (f, d), b + "ffn_up.weight": (f, d), b + "ffn_down.weight": (d, f)}
            shapes |= self.attention.extra_shapes(cfg, i, b)
            if cfg.is_moe(i):
                shapes |= self.shared.shapes(cfg, b)
            if i >= cfg.n_layer:
                shapes |= {b + "nextn.eh_proj.weight": (d, 2 * d), b + "nextn.enorm.weight": (d,), b + "nextn.hnorm.weight": (d,)}
                shapes |= {b + norm: (d,) for norm in self.mtp_norms}
        return shapes

    # ---- writing a file ------------------------------------------------------------------------------------------

    def add_hparams(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        """The architecture keys llama.cpp reads (shared by full models and slices). Keys of later features are
        written only when used, so older models' files stay byte-identical."""
        w.add_name(cfg.name)
        w.add_context_length(cfg.context_length)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer + cfg.n_nextn)
        w.add_feed_forward_length(cfg.n_ff_dense or cfg.n_ff_exp)
        w.add_head_count(list(cfg.n_head_layers) or cfg.n_head)
        w.add_head_count_kv(list(cfg.n_head_kv_layers) or cfg.n_head_kv)
        key_length, value_length = cfg.gguf_kv_lengths
        w.add_key_length(key_length)
        w.add_value_length(value_length)
        w.add_rope_dimension_count(cfg.rope_dim)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_eps)
        w.add_vocab_size(cfg.n_vocab)
        w.add_expert_count(cfg.n_expert)
        w.add_expert_used_count(cfg.n_expert_used)
        w.add_expert_feed_forward_length(cfg.n_ff_exp)
        self.shared.write(w, cfg)
        if cfg.n_nextn:
            w.add_nextn_predict_layers(cfg.n_nextn)
        self.schedule.write(w, cfg)
        self.router.write(w, cfg)
        self.window.write(w, cfg)
        self.write_extra(w, cfg)
        if cfg.rope_theta_swa:
            w.add_rope_freq_base_swa(cfg.rope_theta_swa)
        self.attention.write(w, cfg)
        if cfg.yarn_orig_ctx:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            if cfg.yarn_factor:
                w.add_rope_scaling_factor(cfg.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(cfg.yarn_orig_ctx)
        for fixed in self.fixed_keys:
            fixed.write(w, cfg)

    def write_extra(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        """The keys of :meth:`read_extra`."""

    # ---- random models -------------------------------------------------------------------------------------------

    def random_config(
        self,
        *,
        n_layer: int = 2,
        n_embd: int = 64,
        n_head: int = 4,
        n_head_kv: int | None = None,
        head_dim: int | None = None,
        n_expert: int = 8,
        n_expert_used: int = 2,
        n_ff_exp: int = 32,
        n_ff_shexp: int | None = None,
        n_vocab: int,
        mla_kv_b: bool = False,
    ) -> ModelConfig:
        """A small model of this arch with every feature on (:attr:`random`); see :func:`experts.random_model.random_config`."""
        from ..config import ModelConfig  # experts.config looks archs up by name: imported here, not at the top

        att, feat = self.attention, self.random
        if n_head_kv is None:
            n_head_kv = n_head if att.mha_only else 2
        elif att.mha_only and n_head_kv != n_head:
            raise ModelFormatError(f"{self.name} needs as many KV heads as heads ({n_head}); got {n_head_kv}")
        n_ff_shexp = self.shared.random_width(self.name, n_ff_exp, n_ff_shexp)
        if not 0 < n_expert_used <= n_expert:
            raise ModelFormatError(f"top-k {n_expert_used} must be between 1 and the expert count {n_expert}")
        if mla_kv_b and not att.latent:
            raise ModelFormatError(f"{self.name} has no latent attention: the attn_kv_b layout is deepseek2's")
        fields = att.random_fields(head_dim or n_embd // n_head, n_head, n_head_kv, n_layer, mla_kv_b)
        head_dim, n_head_kv = fields.pop("head_dim", head_dim or n_embd // n_head), fields.pop("n_head_kv", n_head_kv)
        if n_layer <= feat.n_dense_lead:
            raise ModelFormatError(f"{self.name} random models have {feat.n_dense_lead} dense lead layer(s); give more than {feat.n_dense_lead} layers")
        if n_layer < feat.moe_step:
            raise ModelFormatError(f"{self.name} random models have experts on every layer i with (i + 1) % {feat.moe_step} == 0; give at least {feat.moe_step} layers")
        groups, used = feat.groups
        if not (groups and n_expert % groups == 0 and groups < n_expert and n_expert_used <= used * (n_expert // groups)):
            groups = used = 0  # too few experts for the arch's groups: plain top-k
        cfg = ModelConfig(
            arch=self.name,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            n_ff_shexp=n_ff_shexp,
            rms_eps=1e-6,
            rope_theta=10000.0,
            context_length=512,
            name=f"random-{self.name}",
            n_nextn=feat.n_nextn,
            n_dense_lead=feat.n_dense_lead,
            n_ff_dense=2 * n_ff_exp if feat.n_dense_lead or feat.moe_step > 1 else 0,
            n_rot=head_dim // feat.rot_div if feat.rot_div > 1 else 0,
            gating=feat.gating,
            norm_topk=feat.norm_topk,
            expert_weights_scale=feat.scale,
            n_expert_groups=groups,
            n_group_used=used,
            rope_theta_swa=feat.rope_theta_swa,
            yarn_factor=feat.yarn_factor,
            yarn_orig_ctx=feat.yarn_orig_ctx,
            yarn_log_mul=feat.yarn_log_mul,
            moe_step=feat.moe_step,
            **self.window.random(feat.n_swa),
            **fields,
        )
        return self.random_extra(cfg)

    def random_extra(self, cfg: ModelConfig) -> ModelConfig:
        """A random config with the fields of :meth:`read_extra` set."""
        return cfg

    # ---- forward quirks (experts.forward.Backbone asks) ----------------------------------------------------------

    def uses_rope(self, layer: int) -> bool:
        """False on NoPE layers, which rotate nothing (and scale q by :attr:`attn_temp` instead)."""
        return True

    def rope_dim_at(self, cfg: ModelConfig, layer: int) -> int:
        """Rotated dims of a head on *layer*."""
        return cfg.rope_dim

    def rope_factors(self, cfg: ModelConfig, layer: int, factors: np.ndarray | None) -> np.ndarray | None:
        """The rope_freqs factors *layer* divides its angles by (all layers by default)."""
        return factors

    def qk_norm_after_rope(self, cfg: ModelConfig) -> bool:
        """Whether q and k get a weightless RMS norm after RoPE (llama4)."""
        return False

