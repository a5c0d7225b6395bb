"""Write a MoE model as GGUF the way llama.cpp's converter lays it out.

Used by the random-model generator, the embedded-model training script and the
slice writer, so every GGUF we make has one layout: tensor names and shapes
llama.cpp loads, stacked experts with the expert index outermost (ggml ne[2]).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .arch import QKNorm, SharedExpert
from .config import ModelConfig, TokenizerSpec
from .errors import ModelFormatError


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shapes (ggml ne reversed) of every tensor llama.cpp loads for *cfg* (optional ones included).

    MoE layers carry the router and the stacked experts, dense layers (``cfg.is_moe`` false) a plain
    FFN; trailing MTP blocks (``n_nextn``) are MoE layers plus their ``nextn.*`` tensors.
    """
    spec = cfg.spec
    e, ff, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, d),
        "output_norm.weight": (d,),
        "output.weight": (cfg.n_vocab, d),
    }
    if spec.rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.rope_freqs_len,)
    for i in range(cfg.n_layer + cfg.n_nextn):
        b = f"blk.{i}."
        q_dim, kv_dim = cfg.heads(i) * cfg.head_dim, cfg.kv_heads(i) * cfg.head_dim
        # Insertion order is the random models' draw order: keep it, or every random model's weights (and digest) change.
        shapes[b + "attn_norm.weight"] = (d,)
        if spec.mla:
            shapes |= mla_shapes(cfg, b)
        elif cfg.is_recurrent(i):
            shapes |= delta_net_shapes(cfg, b)
        elif spec.delta_net:  # gated full attention: per head [q, gate] rows
            shapes |= {b + "attn_q.weight": (2 * cfg.q_dim, d), b + "attn_k.weight": (cfg.kv_dim, d), b + "attn_v.weight": (cfg.kv_dim, d)}
            shapes[b + "attn_output.weight"] = (d, cfg.q_dim)
        else:
            if spec.fused_qkv:
                shapes[b + "attn_qkv.weight"] = (q_dim + 2 * kv_dim, d)
            else:
                shapes |= {b + "attn_q.weight": (q_dim, d), b + "attn_k.weight": (kv_dim, d), b + "attn_v.weight": (kv_dim, d)}
            shapes[b + "attn_output.weight"] = (d, q_dim)
            if spec.head_gate:
                shapes[b + "attn_gate.weight"] = (cfg.heads(i), d)
        shapes[b + spec.ffn_norm + ".weight"] = (d,)
        if cfg.is_moe(i):
            shapes |= {
                b + "ffn_gate_inp.weight": (e, d),
                b + "ffn_gate_exps.weight": (e, ff, d),
                b + "ffn_up_exps.weight": (e, ff, d),
                b + "ffn_down_exps.weight": (e, d, ff),
            }
            if spec.selection_bias:
                shapes[b + "exp_probs_b.bias"] = (e,)
            if spec.router_bias:
                shapes[b + "ffn_gate_inp.bias"] = (e,)
            if spec.expert_bias:
                shapes |= {b + "ffn_gate_exps.bias": (e, ff), b + "ffn_up_exps.bias": (e, ff), b + "ffn_down_exps.bias": (e, d)}
        else:
            f = cfg.n_ff_dense
            shapes |= {b + "ffn_gate.weight": (f, d), b + "ffn_up.weight": (f, d), b + "ffn_down.weight": (d, f)}
        if spec.qkv_bias:
            shapes |= {
                b + "attn_q.bias": (q_dim,),
                b + "attn_k.bias": (kv_dim,),
                b + "attn_v.bias": (kv_dim,),
            }
        if spec.attn_out_bias:
            shapes[b + "attn_output.bias"] = (d,)
        if spec.attn_sinks:
            shapes[b + "attn_sinks.weight"] = (cfg.heads(i),)
        if spec.qk_norm is QKNorm.PER_HEAD and not cfg.is_recurrent(i):
            shapes |= {b + "attn_q_norm.weight": (cfg.head_dim,), b + "attn_k_norm.weight": (cfg.head_dim,)}
        elif spec.qk_norm is QKNorm.WHOLE:
            shapes |= {b + "attn_q_norm.weight": (q_dim,), b + "attn_k_norm.weight": (kv_dim,)}
        if cfg.n_ff_shexp and cfg.is_moe(i):
            s = cfg.n_ff_shexp
            if spec.shared_expert is SharedExpert.SIGMOID_GATED:
                shapes[b + "ffn_gate_inp_shexp.weight"] = (d,)
            shapes |= {
                b + "ffn_gate_shexp.weight": (s, d),
                b + "ffn_up_shexp.weight": (s, d),
                b + "ffn_down_shexp.weight": (d, s),
            }
        if i >= cfg.n_layer:
            shapes |= {b + "nextn.eh_proj.weight": (d, 2 * d), b + "nextn.enorm.weight": (d,), b + "nextn.hnorm.weight": (d,)}
            shapes |= {b + norm: (d,) for norm in spec.mtp_norms}
    return shapes


def mla_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    """One deepseek2 layer's attention tensors (src/models/deepseek2.cpp ``load_arch_tensors``)."""
    d, n, lat, rope, v = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim, cfg.v_head_dim
    nope = cfg.head_dim - rope
    shapes: dict[str, tuple[int, ...]] = {
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


def delta_net_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    """One gated delta-net layer's tensors (qwen3next.cpp / qwen35moe.cpp ``load_arch_tensors``), attn_qkv + attn_gate
    (a qwen3next file may carry the legacy ssm_in instead: :meth:`experts.gguf_model.GGUFModel._check_shapes`)."""
    d, n_v, value = cfg.n_embd, cfg.ssm_v_heads, cfg.gdn_value_dim
    shapes: dict[str, tuple[int, ...]] = {
        b + "attn_qkv.weight": (cfg.gdn_conv_dim, d),
        b + "attn_gate.weight": (value, d),
        b + "ssm_conv1d.weight": (cfg.gdn_conv_dim, cfg.ssm_conv),
        b + "ssm_dt.bias": (n_v,),
        b + "ssm_a": (n_v,),
    }
    if cfg.spec.gdn_split_ba:
        shapes |= {b + "ssm_beta.weight": (n_v, d), b + "ssm_alpha.weight": (n_v, d)}
    else:
        shapes[b + "ssm_ba.weight"] = (2 * n_v, d)
    return shapes | {b + "ssm_norm.weight": (cfg.ssm_state,), b + "ssm_out.weight": (d, value)}


def gdn_ssm_in_shape(cfg: ModelConfig) -> tuple[int, int]:
    """The legacy ssm_in: per k head [q, k, v, z] rows (qwen3next's ``qkvz_dim``)."""
    return 2 * cfg.gdn_key_dim + 2 * cfg.gdn_value_dim, cfg.n_embd


# Small tensors stay F32 whatever the requested type, as llama.cpp's converter does:
# norms, biases (the stacked expert biases too) and the router are tiny and precision-sensitive.
def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith((".bias", "ffn_gate_inp.weight", "ssm_conv1d.weight"))


def imrope_sections(cfg: ModelConfig) -> list[int]:
    """IMROPE's time/height/width split of the rotated pairs in Qwen3-VL's proportions (24/20/20/0 of 64); a text
    forward never sees it (all sections hold the token's position), but llama.cpp requires the key."""
    pairs = cfg.rope_dim // 2
    hw = pairs * 5 // 16
    return [pairs - 2 * hw, hw, hw, 0]


# What the writer stores under an ArchSpec.fixed_keys key that accepts any value.
FIXED_KEY_VALUES = {"rope.dimension_sections": imrope_sections}


def add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The architecture keys llama.cpp reads (shared by full models and slices).

    Keys of later features are written only when used, so older models' files stay byte-identical.
    """
    spec = cfg.spec
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
    if spec.shexp_from_count:
        w.add_expert_shared_count(cfg.n_ff_shexp // cfg.n_ff_exp)
    elif cfg.n_ff_shexp and not spec.shexp_expert_width:
        w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    if cfg.n_nextn:
        w.add_nextn_predict_layers(cfg.n_nextn)
    if cfg.n_dense_lead:
        w.add_leading_dense_block_count(cfg.n_dense_lead)
    if cfg.gating is not None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[cfg.gating.upper()])
    if cfg.norm_topk is not None:
        w.add_expert_weights_norm(cfg.norm_topk)
    if cfg.expert_weights_scale:
        w.add_expert_weights_scale(cfg.expert_weights_scale)
    if cfg.n_expert_groups:
        w.add_expert_group_count(cfg.n_expert_groups)
        w.add_expert_group_used_count(cfg.n_group_used)
    if cfg.moe_step:
        w.add_interleave_moe_layer_step(cfg.moe_step)
    if cfg.n_swa and spec.chunked_attn:  # the chunk size is fixed by llama.cpp: only a non-default pattern is written
        if cfg.swa_period != spec.chunk_period:
            w.add_sliding_window_pattern(cfg.swa_period)
    elif cfg.n_swa:
        w.add_sliding_window(cfg.n_swa)
        w.add_sliding_window_pattern(list(cfg.swa_pattern) or cfg.swa_period)
    if cfg.clamp_exp:
        w.add_swiglu_clamp_exp(list(cfg.clamp_exp))
    if cfg.clamp_shexp:
        w.add_swiglu_clamp_shexp(list(cfg.clamp_shexp))
    if cfg.rope_theta_swa:
        w.add_rope_freq_base_swa(cfg.rope_theta_swa)
    if cfg.kv_lora_rank:
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        if not cfg.mla_kv_b:
            w.add_key_length_mla(cfg.head_dim)
            w.add_value_length_mla(cfg.v_head_dim)
        if cfg.yarn_log_mul:
            w.add_rope_scaling_yarn_log_mul(0.1 * cfg.yarn_log_mul)
    if cfg.yarn_orig_ctx:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        if cfg.yarn_factor:
            w.add_rope_scaling_factor(cfg.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(cfg.yarn_orig_ctx)
    if spec.delta_net:
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
    for key, only in spec.fixed_keys:
        if only is None and key not in FIXED_KEY_VALUES:
            continue  # one of the keys every model gets (above)
        value = FIXED_KEY_VALUES[key](cfg) if only is None else only
        if isinstance(value, list):
            w.add_array(f"{cfg.arch}.{key}", value)
        else:
            w.add_uint32(f"{cfg.arch}.{key}", value)


@dataclass(frozen=True)
class PlannedTensor:
    """What a GGUF header says about a tensor before its bytes exist: a writer streams the data after the header."""

    name: str
    shape: tuple[int, ...]  # numpy shape of the float tensor (ggml ne reversed)
    qtype: gguf.GGMLQuantizationType

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return gguf.quant_shape_to_byte_shape(self.shape, self.qtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape))


def write_model(
    path: str | Path,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    tokenizer: TokenizerSpec,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    extra_kv: Mapping[str, object] | None = None,
) -> None:
    """Write *tensors* (float arrays, numpy shapes) quantized to *qtype* where allowed.

    Each tensor is quantized as it is written, so the quantized copies never all exist at once.
    """
    plan = [PlannedTensor(name, arr.shape, gguf.GGMLQuantizationType.F32 if keeps_f32(name, arr.shape) else qtype) for name, arr in tensors.items()]
    write_streamed(path, cfg, tokenizer, plan, (pack_tensor(tensors[t.name], t.qtype) for t in plan), quantized=qtype != gguf.GGMLQuantizationType.F32, extra_kv=extra_kv)


def pack_tensor(arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """*arr* as :func:`write_streamed` takes it: float32, or quantized by gguf-py to *qtype*."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    return arr if qtype == gguf.GGMLQuantizationType.F32 else gguf.quantize(arr, qtype)


def write_streamed(
    path: str | Path,
    cfg: ModelConfig,
    tokenizer: TokenizerSpec,
    plan: Sequence[PlannedTensor],
    data: Iterable[np.ndarray],
    *,
    quantized: bool,
    extra_kv: Mapping[str, object] | None = None,
) -> None:
    """Write a GGUF whose tensors are *plan*, pulling each one's data from *data* only when it is written.

    Why: the header (KV data and every tensor's name, shape, type and offset) depends only on shapes, so it goes
    first and each tensor's bytes follow one at a time: a writer holds one tensor, not the file (a 30B-shaped random
    model is ~7x its file as float32). *data* yields, in plan order, float32 arrays for F32 entries and the packed
    data of the others (any dtype: gguf-py's quantize gives uint8 blocks, float16 for F16), checked by size. *quantized* picks the file-type key (ALL_F32 or GUESSED).
    """
    w = gguf.GGUFWriter(str(path), cfg.arch)
    add_hparams(w, cfg)
    w.add_file_type(gguf.LlamaFileType.GUESSED if quantized else gguf.LlamaFileType.ALL_F32)

    t = tokenizer
    w.add_tokenizer_model(t.model)
    w.add_tokenizer_pre(t.pre)
    w.add_token_list(t.tokens)
    w.add_token_types(t.token_types)
    if t.scores is not None:
        w.add_token_scores(t.scores)
    if t.merges is not None:
        w.add_token_merges(t.merges)
    if t.bos_id is not None:
        w.add_bos_token_id(t.bos_id)
    w.add_eos_token_id(t.eos_id)
    if t.unk_id is not None:
        w.add_unk_token_id(t.unk_id)
    if t.pad_id is not None:
        w.add_pad_token_id(t.pad_id)
    w.add_add_bos_token(t.add_bos)
    for key, value in {**t.extra, **(extra_kv or {})}.items():
        _add_kv(w, key, value)

    f32 = gguf.GGMLQuantizationType.F32
    for p in plan:
        if p.qtype == f32:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes)
        else:
            w.add_tensor_info(p.name, p.byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
    source = iter(data)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for p in plan:
            arr = next(source, None)
            if arr is None or arr.nbytes != p.nbytes or (p.qtype == f32 and arr.dtype != np.float32):
                got = "nothing" if arr is None else f"{arr.nbytes} bytes of {arr.dtype}"
                raise ModelFormatError(f"{p.name}: the header promised {p.nbytes} bytes of {p.qtype.name}, the data was {got}")
            w.write_tensor_data(np.ascontiguousarray(arr))
        if next(source, None) is not None:
            raise ModelFormatError(f"more tensor data than the {len(plan)} tensors the header lists")
    except BaseException:
        w.close()
        Path(path).unlink(missing_ok=True)  # a truncated file must not pass for a model (also on Ctrl-C)
        raise
    w.close()


def _add_kv(w: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"cannot store {type(value).__name__} under GGUF key {key}")
