"""The dense part of a MoE transformer in numpy, with the MoE step as a pluggable hook.

Every matmul is batch invariant (see :mod:`experts.moe`): a token's logits are the same
bits whether it is decoded alone, verified in a speculative draft or batched with other
sequences, which is what makes those optimisations exactly output-preserving.

Mirrors llama.cpp's graphs for qwen2moe / qwen3moe / llama(+experts) / olmoe / glm4moe / minimax-m2 / gpt-oss / llama4 / deepseek2 / qwen3next / qwen35moe / step35 (and the extras in experts/archs/; the gated delta-net layers in experts/delta_net.py): the per-arch
differences come from the model's :class:`experts.archs.Arch` (its mechanism parts, and its family's quirk methods). The routed-expert sum is the one
thing computed elsewhere: ``moe_ffn(layer, hidden, expert_ids, weights) -> Future[routed_sum]``
(llama.cpp's ``build_moe_ffn`` seam). Locally it is :func:`experts.moe.grouped_moe` through
:func:`local_moe`; in the swarm it is a dispatch to the workers that host the chosen experts. The router,
the shared expert and the dense layers' FFNs stay here, next to the hidden state they read: the hook
is only called for layers that have experts (``cfg.is_moe``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from .arch import QKNorm, RopeStyle
from .delta_net import DeltaNet, advance
from .dense_weights import FFN, DenseLinear, DenseWeights, Linear, PackedWeights, mm, weights_for
from .dsa import Indexer
from .errors import ModelFormatError
from .gguf_model import GGUFModel
from .kda import KimiDelta
from .kernels import Kernel
from .layer_span import LayerSpan
from .moe import route, route_margin, sigmoid, slot_sum, softmax, weight_inputs
from .msa import BlockIndexer, sparse_rows

# The hook returns a Future of the routed sum, always: the forward computes the shared expert (an
# independent additive term) while a remote round trip is in flight, then waits, in one place.
MoeFfn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], "Future[np.ndarray]"]
# The routed sum computed on the calling thread (e.g. experts.moe.grouped_moe with its store bound).
MoeCompute = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def local_moe(compute: MoeCompute) -> MoeFfn:
    """*compute* as a hook: the sum is computed at the call and handed back as a completed Future.

    A local path has no round trip to hide; the completed Future keeps every hook one shape,
    so the forward waits for the routed sum in one place whoever computes it.
    """

    def hook(layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> Future[np.ndarray]:
        done: Future[np.ndarray] = Future()
        done.set_result(compute(layer, x, ids, w))
        return done

    return hook


def rms_norm(x: np.ndarray, w: np.ndarray | np.float32, eps: float) -> np.ndarray:
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps).astype(np.float32)) * w


@dataclass(frozen=True)
class Yarn:
    """YaRN as ggml's ``rope_yarn`` applies it; beta 32/1 whatever the file says (llama-cpp-python passes those)."""

    factor: float  # rope.scaling.factor: frequencies are interpolated by 1/factor
    orig_ctx: int  # rope.scaling.original_context_length
    log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier (deepseek2's mscale_all_dim); 0: not in the file
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @property
    def magnitude(self) -> float:
        """What cos and sin carry: ggml's ``1 + 0.1 ln factor``, times llama-context's attn_factor, which cancels it
        (and so leaves 1) when the file has a log multiplier (deepseek2: mscale / mscale_all_dim = 1)."""
        return 1.0 if self.log_mul else 1.0 + 0.1 * float(np.log(self.factor))

    @property
    def attn_mscale(self) -> float:
        """deepseek2's mscale, squared into its attention scale: the cos/sin magnitude times ``1 + 0.1 log_mul ln factor``."""
        return self.magnitude * (1.0 + 0.1 * self.log_mul * float(np.log(self.factor)))

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        """The pair indices where the ramp from extrapolated to interpolated frequencies starts and ends."""

        def dim(beta: float) -> float:
            return n_rot * np.log(self.orig_ctx / (beta * 2 * np.pi)) / (2 * np.log(base))

        return max(0.0, float(np.floor(dim(self.beta_fast)))), min(n_rot - 1.0, float(np.ceil(dim(self.beta_slow))))

    def angles(self, theta: np.ndarray, n_rot: int, base: float) -> tuple[np.ndarray, float]:
        """(angles, magnitude): each pair's angle mixed between theta/factor and theta by the ramp, and the
        :attr:`magnitude` that cos and sin carry."""
        lo, hi = self.corr_dims(n_rot, base)
        i = np.arange(theta.shape[-1], dtype=np.float64)
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)  # ext_factor 1
        interp = theta / self.factor
        return interp * (1.0 - ramp) + theta * ramp, self.magnitude


def rope(
    x: np.ndarray, pos: np.ndarray, theta_base: float, style: RopeStyle, n_rot: int | None = None, yarn: Yarn | None = None, factors: np.ndarray | None = None
) -> np.ndarray:
    """Rotate the first *n_rot* dims (default all) of x (n, heads, head_dim) by positions pos (n,).

    As ggml: the frequencies are over n_rot, not head_dim, and the other dims pass through; each pair's
    angle is divided by its frequency factor (``rope_freqs.weight``) when the model has them.
    """
    if n_rot is not None and n_rot < x.shape[-1]:
        return np.concatenate([rope(x[..., :n_rot], pos, theta_base, style, yarn=yarn, factors=factors), x[..., n_rot:]], axis=-1)
    hd = x.shape[-1]
    inv = theta_base ** (-np.arange(0, hd // 2, dtype=np.float64) * 2.0 / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    if factors is not None:
        ang = ang / factors.astype(np.float64)[None, :]
    mag = 1.0
    if yarn is not None:
        ang, mag = yarn.angles(ang, hd, theta_base)
    cos = (np.cos(ang) * mag).astype(np.float32)[:, None, :]
    sin = (np.sin(ang) * mag).astype(np.float32)[:, None, :]
    if style is RopeStyle.NEOX:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def sink_softmax(scores: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """softmax over the last axis of (heads, 1, t), each head's sink logit (unscaled) joining the max and the
    denominator but no output, as ggml's soft_max with sinks; without sinks, the plain softmax."""
    if sinks is None:
        return softmax(scores)
    s = sinks.astype(np.float32)[:, None, None]
    m = np.maximum(scores.max(axis=-1, keepdims=True), s)
    e = np.exp(scores - m)
    return e / (e.sum(axis=-1, keepdims=True) + np.exp(s - m))


def attn_temperature(pos: np.ndarray, temp: tuple[float, float, float]) -> np.ndarray:
    """llama.cpp's per-position query scale on NoPE layers (``llm_graph_input_attn_temp``): log(floor((pos + offset) /
    floor_) + 1) * scale + 1, computed in double and stored as float32, as there. 1.0 before position floor_ - offset."""
    floor_, scale, offset = temp
    return (np.log(np.floor((pos.astype(np.float64) + offset) / floor_) + 1.0) * np.float32(scale) + 1.0).astype(np.float32)


@dataclass
class KVCache:
    """Per-layer keys/values of the positions seen so far (float32, as llama.cpp with type_k/v=F32).

    An MLA layer keeps one row per position, its latent then its roped key part (``cfg.kv_cache_floats``: 576
    for DeepSeek-V3); its values are the latent columns of those rows, so its ``v`` is zero-width. A gated delta-net
    layer keeps its recurrence's inputs per position as its ``k`` (zero-width ``v``) and checkpoints of its matrix
    state in ``states`` (:mod:`experts.delta_net`), so cutting positions off stays a slice. A minimax-m3 sparse layer
    keeps its index branch's key per position in ``index`` (:mod:`experts.msa`).
    """

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)
    states: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # recurrent layer -> {position: state after it}
    index: dict[int, np.ndarray] = field(default_factory=dict)  # MSA layer -> (positions, width) index keys

    @property
    def n_past(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def extend(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append layer *i*'s keys and values of the new positions (layers are filled in order, one pass each)."""
        if len(self.k) <= i:
            self.k.append(k)
            self.v.append(v)
        else:
            self.k[i] = np.concatenate([self.k[i], k])
            self.v[i] = np.concatenate([self.v[i], v])

    def extend_index(self, i: int, keys: np.ndarray) -> None:
        """Append MSA layer *i*'s index keys of the new positions."""
        self.index[i] = np.concatenate([self.index[i], keys]) if i in self.index else keys

    def truncate(self, n: int) -> None:
        """Forget positions >= n (rejected speculative tokens)."""
        self.k = [k[:n] for k in self.k]
        self.v = [v[:n] for v in self.v]
        self.states = {i: {p: s for p, s in st.items() if p <= n} for i, st in self.states.items()}
        self.index = {i: a[:n] for i, a in self.index.items()}

    def prefix(self, n: int, copy: bool = False) -> KVCache:
        """A cache of the first *n* positions: views of these arrays (the forward replaces arrays, never writes into
        them), or with *copy* compact copies that keep nothing else alive."""
        own = np.array if copy else (lambda a: a)
        states = {i: {p: s for p, s in st.items() if p <= n} for i, st in self.states.items()}
        return KVCache([own(k[:n]) for k in self.k], [own(v[:n]) for v in self.v], states, {i: own(a[:n]) for i, a in self.index.items()})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in [*self.k, *self.v, *self.index.values()]) + sum(s.nbytes for st in self.states.values() for s in st.values())


@dataclass(frozen=True)
class MLA:
    """One layer's multi-head latent attention weights (deepseek2), absorbed as llama.cpp runs current files.

    Every head's key and value are linear in one shared latent ``c`` (kv_lora_rank wide), so the cache keeps
    ``[c, k_pe]`` and each head scores ``k_b[h] q_nope[h]`` against ``c`` (plus ``q_pe . k_pe``), then maps its
    latent average to a value with ``v_b[h]``: MQA over a latent-wide head. A legacy ``attn_kv_b`` file is split
    into the same per-head matrices when loaded (the converter's split, in float32: its key half is used
    transposed), so both layouts run this one path; llama.cpp decompresses legacy files into plain MHA instead,
    which re-associates the same sums.
    """

    wq_a: Linear | None  # attn_q_a, the q-LoRA down projection; None: attn_q alone ("lite")
    q_a_norm: np.ndarray | None
    wq: Linear  # attn_q_b (or attn_q): (n_head * head_dim) query rows
    wkv_a: Linear  # attn_kv_a_mqa: [latent, k_pe] of the token
    kv_a_norm: np.ndarray
    k_b: list[Linear]  # per head: q_nope (nope) -> latent
    v_b: list[Linear]  # per head: latent -> value (v_head_dim)
    indexer: Indexer | None = None  # deepseek32's trunk layers: the positions each query reads (experts.dsa)

    @classmethod
    def load(cls, model: GGUFModel, lin, b: str, *, sparse: bool = False) -> MLA:
        cfg, d = model.cfg, model.dense
        if cfg.mla_kv_b:
            nope = cfg.head_dim - cfg.rope_dim
            kv = d(b + "attn_kv_b.weight").reshape(cfg.n_head, nope + cfg.v_head_dim, cfg.kv_lora_rank)
            k_b: list[Linear] = [DenseLinear(np.ascontiguousarray(w[:nope].T)) for w in kv]
            v_b: list[Linear] = [DenseLinear(np.ascontiguousarray(w[nope:])) for w in kv]
        else:
            k_b, v_b = lin.stacked(b + "attn_k_b.weight"), lin.stacked(b + "attn_v_b.weight")
        lora = cfg.q_lora_rank > 0
        return cls(
            wq_a=lin.linear(b + "attn_q_a.weight") if lora else None,
            q_a_norm=d(b + "attn_q_a_norm.weight") if lora else None,
            wq=lin.linear(b + ("attn_q_b.weight" if lora else "attn_q.weight")),
            wkv_a=lin.linear(b + "attn_kv_a_mqa.weight"),
            kv_a_norm=d(b + "attn_kv_a_norm.weight"),
            k_b=k_b,
            v_b=v_b,
            indexer=Indexer.load(model, lin, b) if sparse else None,
        )


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray
    wq: Linear | None  # None in an MLA layer: its projections are in *mla*
    wk: Linear | None
    wv: Linear | None
    wo: Linear | None  # None in a gated delta-net layer: its projections are in *gdn*
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None  # attn_output.bias
    sinks: np.ndarray | None  # attn_sinks.weight: one logit per head
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray
    router: Linear | None  # None: a dense layer (no experts), computed by *ffn*
    router_bias: np.ndarray | None  # ffn_gate_inp.bias: added to the logits
    selection_bias: np.ndarray | None  # exp_probs_b: moves the top-k choice, not the weights
    shexp: tuple[np.ndarray | None, FFN] | None  # (sigmoid gate or None for an un-gated one, the expert's gate/up/down)
    ffn: FFN | None  # a dense layer's FFN
    mla: MLA | None = None
    gdn: DeltaNet | KimiDelta | None = None  # a recurrent layer: gated delta-net, or KDA (kimi-linear)
    head_gate: Linear | None = None  # attn_gate (step35): each head's attention output times sigmoid(its row . x)
    msa: BlockIndexer | None = None  # minimax-m3's sparse layers: the blocks each query's groups read (experts.msa)


class Backbone:
    """The dense part of a full model (not its routed experts, which stay mapped).

    Without a *kernel* its matrices are dequantized to float32 once (today's exact bits); with one,
    they stay packed in the file's memory map and the kernel computes on them (see
    :mod:`experts.dense_weights`). Norms and biases are small vectors and are always float32.
    """

    def __init__(self, model: GGUFModel, kernel: Kernel | None = None, *, layers: range | None = None, head: bool = True) -> None:
        """*layers* (default every trunk layer) are the layers loaded, *head* whether the embeddings and output head
        are: a stage loads its layers without the head, a client the head without layers (experts/stage_forward.py),
        each from slices (:class:`experts.model_parts.SlicedModel`) that hold only those tensors."""
        if model.is_slice:
            raise ModelFormatError(f"{model.path} is a slice; the backbone needs the full model file (give --model the file the slice was cut from)")
        self.model = model
        self.kernel = kernel
        self.cfg = cfg = model.cfg
        self.arch = cfg.spec
        d = model.dense
        lin = weights_for(model, kernel)
        opt = lambda name: d(name) if model.has(name) else None  # noqa: E731
        if head:  # a stage has none: forward() is the client's, a stage runs blocks (StageRunner)
            self.tok_embd = lin.linear("token_embd.weight")
            self.output_norm = d("output_norm.weight")
            self.output = lin.linear("output.weight") if model.has("output.weight") else self.tok_embd
        self._weights = lin
        self.layers = [self._load_layer(i) for i in range(cfg.n_layer)] if layers is None else LayerSpan(layers.start, [self._load_layer(i) for i in layers])
        self.router_params = cfg.router
        self.rope_freqs = opt("rope_freqs.weight") if self.arch.attention.rope_freqs else None
        # llama4's weightless q/k norm after RoPE, which llama.cpp leaves out for 128-expert models (Maverick)
        self.qk_norm_after_rope = self.arch.qk_norm_after_rope(cfg)
        self.yarn = Yarn(cfg.yarn_factor, cfg.yarn_orig_ctx, cfg.yarn_log_mul) if cfg.yarn_factor else None

    def _load_layer(self, i: int) -> Layer:
        """Layer *i*'s weights: a trunk layer, or an MTP block stored after the trunk (:meth:`load_mtp`)."""
        cfg, model, d, lin = self.cfg, self.model, self.model.dense, self._weights
        opt = lambda name: d(name) if model.has(name) else None  # noqa: E731
        b = f"blk.{i}."
        moe = cfg.is_moe(i)
        shexp = None
        if moe and cfg.n_ff_shexp:
            gate = d(b + "ffn_gate_inp_shexp.weight") if self.arch.shared.gated else None
            shexp = (gate, lin.ffn(b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight", b + "ffn_down_shexp.weight", cfg.glu_shexp(i)))
        recurrent = cfg.is_recurrent(i)
        sparse = cfg.indexer_heads > 0 and i < cfg.n_layer  # llama.cpp's deepseek32 MTP graph runs dense MLA
        mla = MLA.load(model, lin, b, sparse=sparse) if self.arch.attention.latent and not recurrent else None  # kimi-linear: MLA between KDA layers
        gdn = (KimiDelta if self.arch.attention.key_decay else DeltaNet).load(model, lin, b) if recurrent else None
        q, k, v = self._qkv(lin, b) if mla is None and gdn is None else (None, None, None)
        return Layer(
            attn_norm=d(b + "attn_norm.weight"),
            wq=q,
            wk=k,
            wv=v,
            wo=None if gdn else lin.linear(b + "attn_output.weight"),
            bq=opt(b + "attn_q.bias"),
            bk=opt(b + "attn_k.bias"),
            bv=opt(b + "attn_v.bias"),
            bo=opt(b + "attn_output.bias"),
            sinks=opt(b + "attn_sinks.weight"),
            q_norm=opt(b + "attn_q_norm.weight"),
            k_norm=opt(b + "attn_k_norm.weight"),
            ffn_norm=d(b + self.arch.ffn_norm + ".weight"),
            router=lin.linear(b + "ffn_gate_inp.weight") if moe else None,
            router_bias=opt(b + "ffn_gate_inp.bias") if moe else None,
            selection_bias=opt(b + "exp_probs_b.bias") if moe else None,
            shexp=shexp,
            ffn=None if moe else lin.ffn(b + "ffn_gate.weight", b + "ffn_up.weight", b + "ffn_down.weight", cfg.glu_shexp(i)),
            mla=mla,
            gdn=gdn,
            head_gate=lin.linear(b + "attn_gate.weight") if model.has(b + "attn_gate.weight") else None,
            msa=BlockIndexer.load(model, lin, b) if cfg.indexer_block_size and i >= cfg.n_dense_lead else None,
        )

    def load_mtp(self) -> list[Layer]:
        """The file's MTP (nextn) blocks as layers ``n_layer`` .. ``n_layer + n_nextn - 1``, loaded on first call.

        They are appended to :attr:`layers` after the trunk, so :meth:`block` runs them by their file index like
        any layer; :meth:`forward` runs the first ``n_layer`` only, as llama.cpp's main graph does.
        """
        n = self.cfg.n_layer
        if len(self.layers) == n:
            self.layers.extend(self._load_layer(n + j) for j in range(self.cfg.n_nextn))
        return self.layers[n:]

    def _qkv(self, lin: DenseWeights | PackedWeights, b: str) -> tuple[Linear, Linear, Linear]:
        """The Q, K and V projections of layer *b*: three tensors, or three row ranges of a fused attn_qkv
        (llama.cpp's build_qkv views the fused product the same way: Q rows, then K, then V)."""
        if not self.arch.attention.fused_qkv:
            return lin.linear(b + "attn_q.weight"), lin.linear(b + "attn_k.weight"), lin.linear(b + "attn_v.weight")
        q, kv, name = self.cfg.q_dim, self.cfg.kv_dim, b + "attn_qkv.weight"
        return lin.linear(name, slice(0, q)), lin.linear(name, slice(q, q + kv)), lin.linear(name, slice(q + kv, q + 2 * kv))

    def attention(self, i: int, h: np.ndarray, pos: np.ndarray, cache: KVCache) -> np.ndarray:
        cfg, L = self.cfg, self.layers[i]
        if L.mla is not None:
            return self.latent_attention(i, L.mla, h, pos, cache)
        if L.gdn is not None:
            return self.linear_attention(i, L.gdn, h, pos, cache)
        assert L.wq is not None and L.wk is not None and L.wv is not None and L.wo is not None, f"layer {i} has no attention projections"
        n, hd, n_head, n_kv = h.shape[0], cfg.head_dim, cfg.heads(i), cfg.kv_heads(i)
        q, k, v = L.wq(h), L.wk(h), L.wv(h)
        attn, gate = self.arch.attention, None
        if attn.gated_q:  # qwen3next's fused Q+gate: per head [q, gate]
            qg = q.reshape(n, cfg.n_head, 2, hd)
            q, gate = np.ascontiguousarray(qg[:, :, 0]).reshape(n, cfg.q_dim), np.ascontiguousarray(qg[:, :, 1]).reshape(n, cfg.q_dim)
        if L.bq is not None:
            q, k, v = q + L.bq, k + L.bk, v + L.bv
        whole = attn.qk_norm is QKNorm.WHOLE  # norm the flat projection, before the split into heads
        if whole:
            assert L.q_norm is not None and L.k_norm is not None, f"layer {i} has no q/k norms"  # required tensors
            q, k = rms_norm(q, L.q_norm, cfg.rms_eps), rms_norm(k, L.k_norm, cfg.rms_eps)
        q = q.reshape(n, n_head, hd)
        k = k.reshape(n, n_kv, hd)
        v = v.reshape(n, n_kv, hd)
        if L.q_norm is not None and not whole:
            assert L.k_norm is not None, f"layer {i} has a q norm but no k norm"
            q, k = rms_norm(q, L.q_norm, cfg.rms_eps), rms_norm(k, L.k_norm, cfg.rms_eps)
        if cfg.uses_rope(i):
            base, n_rot = cfg.rope_base(i), cfg.rope_dim_at(i)
            factors = self.arch.rope_factors(cfg, i, self.rope_freqs)
            factors = None if factors is None else factors[: n_rot // 2]  # step35: one tensor for every layer's width
            q = rope(q, pos, base, attn.rope, n_rot, self.yarn, factors)
            k = rope(k, pos, base, attn.rope, n_rot, self.yarn, factors)
            if self.qk_norm_after_rope:
                one = np.float32(1.0)
                q, k = rms_norm(q, one, cfg.rms_eps), rms_norm(k, one, cfg.rms_eps)
        elif self.arch.attn_temp is not None:
            q = q * attn_temperature(pos, self.arch.attn_temp)[:, None, None]
        cache.extend(i, k, v)
        if (msa := L.msa) is not None:  # minimax-m3: the index branch, normed and roped as the heads are
            prepare = lambda x, w: rope(rms_norm(x, w, cfg.rms_eps), pos, cfg.rope_base(i), attn.rope, cfg.rope_dim_at(i), self.yarn)  # noqa: E731
            cache.extend_index(i, msa.keys(h, prepare))
            iq = msa.queries(h, prepare)
        rep = n_head // n_kv
        scale = np.float32(1.0 / np.sqrt(hd))
        out = np.empty((n, n_head, hd), dtype=np.float32)
        # One query row at a time over exactly its causal keys (on an SWA layer the last n_swa of them, or those
        # of its chunk: cfg.first_key; on an MSA layer those of its groups' chosen blocks): the same shapes (and so
        # the same bits) whether the row is decoded alone, verified inside a speculative draft, or batched.
        for r in range(n):
            t = int(pos[r]) + 1
            if msa is not None:
                out[r] = sparse_rows(q[r], cache.k[i][:t], cache.v[i][:t], msa.select(iq[r], cache.index[i][:t]), scale)
                continue
            s0 = cfg.first_key(i, t - 1)
            K = np.ascontiguousarray(np.repeat(cache.k[i][s0:t], rep, axis=1).transpose(1, 2, 0))  # (heads, hd, t)
            V = np.ascontiguousarray(np.repeat(cache.v[i][s0:t], rep, axis=1).transpose(1, 0, 2))  # (heads, t, hd)
            scores = np.matmul(q[r][:, None, :], K) * scale  # (heads, 1, t)
            out[r] = np.matmul(sink_softmax(scores, L.sinks), V)[:, 0, :]
        if L.head_gate is not None:
            out = out * sigmoid(L.head_gate(h))[:, :, None]
        flat = out.reshape(n, n_head * hd)
        y = L.wo(flat if gate is None else flat * sigmoid(gate))
        return y if L.bo is None else y + L.bo

    def linear_attention(self, i: int, G: DeltaNet | KimiDelta, h: np.ndarray, pos: np.ndarray, cache: KVCache) -> np.ndarray:
        """A gated delta-net (or KDA) layer: its per-position inputs join the cache, then the recurrence runs over them."""
        rows, z = G.inputs(self.cfg, h)
        cache.extend(i, rows, np.empty((h.shape[0], 0), dtype=np.float32))
        return G.output(self.cfg, advance(self.cfg, G.conv, cache.k[i], cache.states.setdefault(i, {}), int(pos[0]), h.shape[0]), z)

    def latent_attention(self, i: int, A: MLA, h: np.ndarray, pos: np.ndarray, cache: KVCache) -> np.ndarray:
        """deepseek2's attention as llama.cpp's absorbed graph: scores over ``[c, k_pe]`` rows, one query row at a
        time over exactly its causal positions (batch invariant, as :meth:`attention`)."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        n, heads, lat, nope = h.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.head_dim - cfg.rope_dim
        qr = h if A.wq_a is None or A.q_a_norm is None else rms_norm(A.wq_a(h), A.q_a_norm, eps)
        q = A.wq(qr).reshape(n, heads, cfg.head_dim)
        kv = A.wkv_a(h)
        style, base = self.arch.attention.rope, cfg.rope_base(i)
        k_pe, q_pe = np.ascontiguousarray(kv[:, lat:]), np.ascontiguousarray(q[..., nope:])
        if cfg.uses_rope(i):  # kimi-linear's MLA is NoPE: its "rope" dims stay as projected
            k_pe = rope(k_pe[:, None], pos, base, style, yarn=self.yarn)[:, 0]
            q_pe = rope(q_pe, pos, base, style, yarn=self.yarn)
        q_abs = np.stack([A.k_b[j](np.ascontiguousarray(q[:, j, :nope])) for j in range(heads)], axis=1)
        queries = np.concatenate([q_abs, q_pe], axis=-1)  # (n, heads, lat + rope)
        rows = np.concatenate([rms_norm(kv[:, :lat], A.kv_a_norm, eps), k_pe], axis=-1)  # (n, lat + rope): what is cached
        idx, neox = A.indexer, lambda x: rope(x, pos, base, RopeStyle.NEOX, cfg.rope_dim, self.yarn)
        cache.extend(i, rows, np.empty((n, 0), dtype=np.float32) if idx is None else idx.keys(h, neox))  # deepseek32: the indexer's keys
        iq, iw = (None, None) if idx is None else idx.queries(qr, h, neox)
        mscale = np.float32(self.yarn.attn_mscale if self.yarn else 1.0)
        scale = mscale * mscale / np.sqrt(np.float32(cfg.head_dim))
        latent = np.empty((n, heads, lat), dtype=np.float32)
        for r in range(n):
            K = cache.k[i][: int(pos[r]) + 1]  # (t, lat + rope)
            if idx is not None:  # DeepSeek Sparse Attention: only the positions the lightning indexer picks
                assert iq is not None and iw is not None
                K = K[idx.select(iq[r], iw[r], cache.v[i][: int(pos[r]) + 1])]
            p = softmax(np.matmul(queries[r], np.ascontiguousarray(K.T)) * scale)  # (heads, t)
            latent[r] = np.matmul(p, np.ascontiguousarray(K[:, :lat]))
        out = np.stack([A.v_b[j](np.ascontiguousarray(latent[:, j])) for j in range(heads)], axis=1)
        wo = self.layers[i].wo
        assert wo is not None
        return wo(out.reshape(n, heads * cfg.v_head_dim))

    def router(self, i: int, x: np.ndarray, margins: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Layer *i*'s (expert ids, weights) for x; *margins*, if given, gets each token's routing margin appended
        (:func:`experts.moe.route_margin`: how near the choice is to another)."""
        L = self.layers[i]
        assert L.router is not None, f"layer {i} is dense: it has no router"
        logits = L.router(x)
        if L.router_bias is not None:
            logits = logits + L.router_bias
        if margins is not None:
            margins.append(route_margin(logits, self.cfg.n_expert_used, self.router_params, L.selection_bias))
        return route(logits, self.cfg.n_expert_used, self.router_params, L.selection_bias)

    def shared_expert(self, i: int, x: np.ndarray) -> np.ndarray | None:
        """The always-on expert; independent of the routed sum, so it can run during a dispatch."""
        sh = self.layers[i].shexp
        if sh is None:
            return None
        gate_inp, ffn = sh
        y = ffn(x)
        if gate_inp is None:
            return y
        g = mm(x, gate_inp[None, :])[:, 0]
        with np.errstate(over="ignore"):
            return y * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g)))[:, None]

    def forward(
        self, tokens: np.ndarray | list[int], cache: KVCache, moe_ffn: MoeFfn, *, hidden: list[np.ndarray] | None = None, margins: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """Run *tokens* (appended after the cache) through the model; logits (n, vocab) for each.

        *hidden*, if given, gets the final hidden state (n, n_embd) appended, output-normed: what the logits are the
        product of, and what an MTP block continues from (llama.cpp's ``t_h_nextn`` of the main graph). *margins*, if
        given, gets each MoE layer's routing margins (n,) appended in layer order (what the verification gate reads).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.cfg.n_vocab:
            raise ValueError(f"token id out of range 0..{self.cfg.n_vocab - 1}")
        pos = np.arange(cache.n_past, cache.n_past + tokens.size)
        x = self.tok_embd.rows(tokens)
        for i in range(self.cfg.n_layer):
            x = self.block(i, x, pos, cache, moe_ffn, margins)
        h = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        if hidden is not None:
            hidden.append(h)
        return self.output(h)

    def block(self, i: int, x: np.ndarray, pos: np.ndarray, cache: KVCache, moe_ffn: MoeFfn, margins: list[np.ndarray] | None = None) -> np.ndarray:
        """Decoder layer *i* over the residual stream x (n, n_embd) at positions *pos*: attention, then the FFN
        (*margins*: as :meth:`forward`'s)."""
        L = self.layers[i]
        h = rms_norm(x, L.attn_norm, self.cfg.rms_eps)
        x = x + self.attention(i, h, pos, cache)
        h = rms_norm(x, L.ffn_norm, self.cfg.rms_eps)
        if L.ffn is not None:  # a dense layer: nothing to dispatch
            return x + L.ffn(h)
        ids, w = self.router(i, h, margins)
        before = self.arch.router.weight_before_expert
        routed = moe_ffn(i, *weight_inputs(h, ids, w)) if before else moe_ffn(i, h, ids, w)
        sh = self.shared_expert(i, h)  # runs while a remote dispatch is in flight
        out = slot_sum(routed.result(), ids.shape[1]) if before else routed.result()
        if sh is not None:
            out = out + sh
        return x + out
