"""Open a GGUF MoE model (or a slice of one) and check it is complete and consistent.

Everything is memory-mapped by gguf-py's reader: opening a 30 GB model reads only
its header, and an expert's weights are read by slicing the mapped tensor along
its outermost dimension (ggml ne[2]), which touches only that expert's pages.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import gguf
import numpy as np

from .arch import EXPERT_BIASES, EXPERT_TENSORS, FUSED_GATE_UP, MTP_OPTIONAL, Gating, SharedExpert, arch_spec
from .config import ModelConfig, TokenizerSpec
from .errors import ModelFormatError, SliceError
from .model_writer import expected_shapes, gdn_ssm_in_shape
from .parts import Part, is_expert_tensor, part_names, tokenizer_blob, tokenizer_fields, tokenizer_line

SLICE_PREFIX = "moeswarm.slice."


def _field(reader: gguf.GGUFReader, key: str, *, required: bool = True, default=None):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelFormatError(f"GGUF key {key!r} is missing; the file was not written by a llama.cpp-compatible converter")
        return default
    value = f.contents()
    return value


@dataclass(frozen=True)
class ExpertRange:
    """A half-open range of expert indices [start, stop)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"empty or negative expert range {self.start}..{self.stop}")

    def __contains__(self, e: object) -> bool:
        return isinstance(e, (int, np.integer)) and self.start <= e < self.stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"{self.start}-{self.stop - 1}"


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    spec = arch_spec(arch)
    a = arch + "."

    def opt(key: str, default):
        return _field(reader, a + key, required=False, default=default)

    n_embd = int(_field(reader, a + "embedding_length"))
    n_nextn = int(opt("nextn_predict_layers", 0))
    n_all = int(_field(reader, a + "block_count"))
    n_layer = n_all - n_nextn  # llama.cpp never runs the MTP blocks
    layered = _read_layer_arrays(reader, a, n_all)
    n_head, n_head_kv = layered.pop("n_head"), layered.pop("n_head_kv")
    n_expert = int(opt("expert_count", 0))
    if n_expert == 0:
        raise ModelFormatError(f"{a}expert_count is missing or 0: this is a dense model, not a Mixture-of-Experts one")
    n_ff_exp = _one_value(_field(reader, a + spec.n_ff_exp_key), a + spec.n_ff_exp_key)
    n_ff_shexp = 0
    if spec.shexp_from_count:
        n_shared = int(_field(reader, a + "expert_shared_count"))
        if n_shared < 1:  # measured: llama.cpp's graph then computes another model (cosine ~0.93 to ours)
            raise ModelFormatError(f"{a}expert_shared_count is 0: {arch} models have a shared expert (llama.cpp's graph assumes one)")
        unit = int(opt("expert_shared_feed_forward_length", 0)) if spec.shexp_unit_key else 0
        n_ff_shexp = (unit or n_ff_exp) * n_shared
    elif spec.shexp_expert_width:
        n_ff_shexp = n_ff_exp
    elif spec.shared_expert is not SharedExpert.NONE:
        n_ff_shexp = int(opt("expert_shared_feed_forward_length", 0))
        if not n_ff_shexp and not spec.shexp_key_only:
            n_ff_shexp = int(_field(reader, a + "feed_forward_length"))
    n_dense_lead = int(opt("leading_dense_block_count", 0)) if spec.dense_lead else 0
    moe_step = int(_field(reader, a + "interleave_moe_layer_step")) if spec.interleave_moe else 0
    if spec.interleave_moe and not 0 < moe_step <= n_layer:
        raise ModelFormatError(f"{a}interleave_moe_layer_step is {moe_step}: with {n_layer} layers that leaves no MoE layer")
    has_dense = n_dense_lead > 0 or moe_step > 1
    head_dim = int(opt("attention.key_length", n_embd // n_head))
    mla = _read_mla(reader, a, head_dim) if spec.mla else {}
    gdn = _read_delta_net(reader, a, n_layer) if spec.delta_net else {}
    head_dim = mla.pop("head_dim", head_dim)
    n_rot = int(opt("rope.dimension_count", head_dim))
    if not spec.mla and int(opt("attention.value_length", head_dim)) != head_dim:
        raise ModelFormatError(f"{a}attention.value_length differs from the key length {head_dim}; moeswarm's attention needs equal K and V heads")
    for key, same in (("attention.key_length_swa", head_dim), ("attention.value_length_swa", head_dim), ("rope.dimension_count_swa", n_rot)):
        if int(opt(key, same)) != same:  # llama.cpp's loader reads them for every arch
            raise ModelFormatError(f"{a}{key} is {opt(key, same)}, not {same}: other head or RoPE sizes on SWA layers are not supported")
    gating = None
    if spec.gating_from_file:
        code = _field(reader, a + "expert_gating_func", required=spec.gating is None, default=0)
        try:
            gating = Gating(int(code)).name.lower() if code else spec.gating.name.lower()  # type: ignore[union-attr]
        except ValueError:
            raise ModelFormatError(f"{a}expert_gating_func is {code}; supported: " + ", ".join(f"{g.value} ({g.name.lower()})" for g in Gating)) from None
    n_groups = int(opt("expert_group_count", 0))
    n_group_used = int(_field(reader, a + "expert_group_used_count")) if n_groups > 1 else 0
    if n_groups > 1 and not (n_expert % n_groups == 0 and 0 < n_group_used < n_groups < n_expert):  # llama.cpp asserts the same
        raise ModelFormatError(f"{a}expert_group_count {n_groups} / expert_group_used_count {n_group_used} do not fit {n_expert} experts (llama.cpp needs 0 < used < groups < experts, groups dividing the experts)")
    n_swa = swa_period = 0
    if spec.swa_layers:  # step35: a window and one SWA flag per block (llama.cpp's get_arr: any other type is refused)
        n_swa = int(_field(reader, a + "attention.sliding_window"))
        pattern = _field(reader, a + "attention.sliding_window_pattern")
        if not isinstance(pattern, list) or len(pattern) != n_all:
            raise ModelFormatError(f"{a}attention.sliding_window_pattern must be an array of {n_all} per-layer flags for {arch}")
        layered["swa_pattern"] = tuple(bool(x) for x in pattern)
    elif spec.swa_period:
        n_swa = int(_field(reader, a + "attention.sliding_window"))
        swa_period = opt("attention.sliding_window_pattern", spec.swa_period)
        if not isinstance(swa_period, int):  # llama.cpp's get_key_or_arr into one period: a per-layer array is another arch's
            raise ModelFormatError(f"{a}attention.sliding_window_pattern must be one period for {arch}, not a per-layer array")
    elif spec.chunked_attn:
        if opt("attention.sliding_window", None) == 0:  # llama.cpp then runs no chunks but still asks for the temperature, and aborts
            raise ModelFormatError(f"{a}attention.sliding_window is 0 (no chunked attention): llama.cpp cannot run such {arch} files, so neither do we")
        n_swa, swa_period = spec.chunked_attn, opt("attention.sliding_window_pattern", spec.chunk_period)
        if not isinstance(swa_period, int):
            raise ModelFormatError(f"{a}attention.sliding_window_pattern must be one period for {arch}, not a per-layer array")
    for key, only in spec.fixed_keys:
        got = _field(reader, a + key)
        if only is not None and got != only:
            raise ModelFormatError(f"{a}{key} is {got}; {arch} runs only with {only} (the one value llama.cpp's {arch} graph computes correctly)")
    scaling = str(opt("rope.scaling.type", "none"))
    if scaling not in ("none", "yarn"):
        raise ModelFormatError(f"{a}rope.scaling.type is {scaling!r}; supported: none, yarn")
    yarn = scaling == "yarn"
    n_ctx = int(_field(reader, a + "context_length"))  # llama.cpp refuses a file without it
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return ModelConfig(
        arch=arch,
        n_vocab=len(tokens.data) if tokens is not None else int(_field(reader, a + "vocab_size")),  # slices keep no vocabulary
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_expert=n_expert,
        n_expert_used=int(_field(reader, a + "expert_used_count")),
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        rms_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", required=spec.requires_rms_eps, default=1e-5)),
        rope_theta=float(opt("rope.freq_base", 10000.0)),
        context_length=n_ctx,
        name=str(_field(reader, "general.name", required=False, default=arch)),
        n_nextn=n_nextn,
        n_dense_lead=n_dense_lead,
        n_ff_dense=_one_value(_field(reader, a + "feed_forward_length"), a + "feed_forward_length") if has_dense else 0,
        n_rot=0 if n_rot == head_dim else n_rot,
        gating=gating,
        norm_topk=bool(opt("expert_weights_norm", False)) if spec.norm_from_file else None,
        expert_weights_scale=float(opt("expert_weights_scale", 0.0)) if spec.scale_from_file else 0.0,
        n_expert_groups=n_groups if n_groups > 1 else 0,  # 1/1 (as GLM files say) means no grouping
        n_group_used=n_group_used,
        n_swa=n_swa,
        swa_period=int(swa_period),
        rope_theta_swa=float(opt("rope.freq_base_swa", spec.swa_rope_base)) if n_swa else 0.0,
        yarn_factor=float(opt("rope.scaling.factor", 0.0)) if yarn else 0.0,  # absent: factor 1, YaRN changes nothing
        yarn_orig_ctx=int(opt("rope.scaling.original_context_length", n_ctx)) if yarn else 0,
        **mla,
        moe_step=moe_step,
        **gdn,
        **layered,
        **(_read_clamps(reader, a, n_all) if spec.swiglu_clamps else {}),
    )


def _read_delta_net(reader: gguf.GGUFReader, a: str, n_layer: int) -> dict:
    """The gated delta-net keys of a qwen3next / qwen35moe file as llama.cpp's ``load_arch_hparams`` reads them (all
    five ssm.* keys required), and the layer schedule: ``attention.recurrent_layers`` if present, else recurrent iff
    ``(i + 1) % full_attention_interval != 0`` (default 4)."""
    ssm = {k: int(_field(reader, a + "ssm." + k)) for k in ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")}
    state, n_v, n_k = ssm["state_size"], ssm["time_step_rank"], ssm["group_count"]
    if not (state > 0 and n_k > 0 and n_v % n_k == 0 and ssm["inner_size"] == state * n_v and ssm["conv_kernel"] > 1):
        raise ModelFormatError(f"{a}ssm.* keys {ssm} do not fit a gated delta-net (llama.cpp needs inner_size = state_size * time_step_rank, time_step_rank a multiple of group_count, conv_kernel > 1)")
    flags = _field(reader, a + "attention.recurrent_layers", required=False)
    if flags is not None:
        if not isinstance(flags, list) or len(flags) < n_layer:
            raise ModelFormatError(f"{a}attention.recurrent_layers must be one flag per layer ({n_layer} at least)")
        kinds = "".join("r" if f else "a" for f in flags[:n_layer])
    else:
        interval = int(_field(reader, a + "full_attention_interval", required=False, default=4))
        if interval < 1:
            raise ModelFormatError(f"{a}full_attention_interval is {interval}; it must be at least 1")
        kinds = "".join("r" if (i + 1) % interval else "a" for i in range(n_layer))
    return {"ssm_conv": ssm["conv_kernel"], "ssm_state": state, "ssm_k_heads": n_k, "ssm_v_heads": n_v, "layer_kinds": kinds}


def _one_value(value, key: str) -> int:
    """A key llama.cpp reads with get_key_or_arr into one value per layer, where moeswarm supports one value for all."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelFormatError(f"{key} differs between layers ({value}); moeswarm supports one value for every layer")
        value = value[0]
    return int(value)


def _read_layer_arrays(reader: gguf.GGUFReader, a: str, n_all: int) -> dict:
    """attention.head_count / head_count_kv, a number or one per block (llama.cpp's get_key_or_arr, which needs
    exactly block_count entries; the KV count defaults to the head count). An array of one count reads as that
    count, so such files keep their digests; other arrays only for archs that run per-layer heads (step35)."""
    arch = a[:-1]
    heads = _field(reader, a + "attention.head_count")
    kv = _field(reader, a + "attention.head_count_kv", required=False, default=heads)
    out: dict = {}
    for value, key, name in ((heads, "attention.head_count", "n_head"), (kv, "attention.head_count_kv", "n_head_kv")):
        if isinstance(value, list) and len(value) != n_all:
            raise ModelFormatError(f"{a}{key} has {len(value)} entries; llama.cpp needs one per block ({n_all})")
        counts = tuple(int(x) for x in (value if isinstance(value, list) else [value]))
        if 0 in counts:
            raise ModelFormatError(f"{a}{key} is 0 on some layer: attention-free layers are not supported")
        out[name] = counts[0]
        if len(set(counts)) > 1:
            if not arch_spec(arch).layer_heads:
                raise ModelFormatError(f"{a}{key} differs between layers; {arch} runs one head count on every layer")
            out[name + "_layers"] = counts
    return out


def _read_clamps(reader: gguf.GGUFReader, a: str, n_all: int) -> dict:
    """step35's SwiGLU clamps, a number or one per block (both optional: none means no clamp), as float32 values."""
    out = {}
    for key, field_ in (("swiglu_clamp_exp", "clamp_exp"), ("swiglu_clamp_shexp", "clamp_shexp")):
        value = _field(reader, a + key, required=False, default=None)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value] * n_all
        if len(values) != n_all:
            raise ModelFormatError(f"{a}{key} has {len(values)} entries; llama.cpp needs one per block ({n_all})")
        if any(v > 1e-6 for v in values):
            out[field_] = tuple(float(np.float32(v)) for v in values)
    return out


def _read_mla(reader: gguf.GGUFReader, a: str, key_length: int) -> dict:
    """The MLA fields of a deepseek2 file, as llama.cpp's loader reads them: both ``*_mla`` lengths present means the
    absorbed layout (attn_k_b/attn_v_b, key_length = latent + rope), else the legacy attn_kv_b one (key_length = the
    query/key head)."""

    def opt(key: str, default):
        return _field(reader, a + key, required=False, default=default)

    if float(opt("attention.temperature_scale", 0.0)):
        raise ModelFormatError(f"{a}attention.temperature_scale is set (Q temperature tuning, Mistral-Large style); moeswarm does not implement it")
    k_mla, v_mla = int(opt("attention.key_length_mla", 0)), int(opt("attention.value_length_mla", 0))
    kv_b = not (k_mla and v_mla)
    head_dim = key_length if kv_b else k_mla
    return {
        "head_dim": head_dim,
        "q_lora_rank": int(opt("attention.q_lora_rank", 0)),
        "kv_lora_rank": int(_field(reader, a + "attention.kv_lora_rank")),
        "v_head_dim": int(opt("attention.value_length", head_dim)) if kv_b else v_mla,
        "mla_kv_b": kv_b,
        # the converter wrote 0.1 * mscale_all_dim; divided in float32 as llama.cpp does (0.1f / 0.1f is exactly 1)
        "yarn_log_mul": float(np.float32(opt("rope.scaling.yarn_log_multiplier", 0.0)) / np.float32(0.1)),
    }


@dataclass(frozen=True)
class SliceInfo:
    """What a slice file holds and which model it came from."""

    model_digest: str
    layers: range  # a head slice: none
    experts: ExpertRange | None  # a dense or head slice holds no experts
    manifest: list[str]  # the config and tokenizer lines, then one "name|type|shape|sha256" line per tensor of the source model
    leaves: dict[str, list[str]]  # expert tensor name -> per-expert sha256 of the source model (expert slices)
    kind: Part = Part.EXPERTS


class GGUFModel:
    """A validated, memory-mapped GGUF MoE model or slice."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"model file {self.path} does not exist")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as exc:
            raise ModelFormatError(f"{self.path} is not a readable GGUF file (truncated or corrupt header: {exc})") from None
        size = self.path.stat().st_size
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelFormatError(
                    f"{self.path} is truncated: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes}, file has {size}"
                )
        self.cfg = read_config(self.reader)
        self.slice = self._read_slice_info()
        self._check_shapes()

    # ---- structure -------------------------------------------------------------------------

    @property
    def is_slice(self) -> bool:
        return self.slice is not None

    @property
    def layers(self) -> range:
        return self.slice.layers if self.slice else range(self.cfg.n_layer)

    @property
    def mtp_layers(self) -> range:
        """The MTP (nextn) blocks after the trunk, in a full file (a slice cuts the trunk's layers only)."""
        return range(0) if self.slice else range(self.cfg.n_layer, self.cfg.n_layer + self.cfg.n_nextn)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers of this file that have experts (a slice's layer range may include dense layers; a dense or
        head slice holds no expert)."""
        if self.slice and self.slice.kind is not Part.EXPERTS:
            return ()
        return tuple(i for i in self.layers if self.cfg.is_moe(i))

    @property
    def experts(self) -> ExpertRange:
        if self.slice is None:
            return ExpertRange(0, self.cfg.n_expert)
        if self.slice.experts is None:
            raise SliceError(f"{self.path} is a {self.slice.kind} slice: it holds no experts (serve experts from the model or an expert slice)")
        return self.slice.experts

    @property
    def kind(self) -> Part | None:
        """What slice this file is (None: the full model)."""
        return self.slice.kind if self.slice else None

    def _read_slice_info(self) -> SliceInfo | None:
        if SLICE_PREFIX + "model_digest" not in self.reader.fields:
            return None
        p = SLICE_PREFIX
        kind_name = _field(self.reader, p + "kind", required=False, default=Part.EXPERTS.value)  # older slices: experts
        try:
            kind = Part(kind_name)
        except ValueError:
            raise ModelFormatError(f"{self.path}: {p}kind is {kind_name!r}; this version reads experts, dense and head slices") from None
        layers = range(0)
        if kind is not Part.HEAD:
            layers = range(int(_field(self.reader, p + "layer_start")), int(_field(self.reader, p + "layer_stop")))
        experts = None
        if kind is Part.EXPERTS:
            experts = ExpertRange(int(_field(self.reader, p + "expert_start")), int(_field(self.reader, p + "expert_stop")))
        try:
            leaves = json.loads(_field(self.reader, p + "leaves"))
        except ValueError:
            raise ModelFormatError(f"{self.path}: {p}leaves is not JSON") from None
        return SliceInfo(
            model_digest=_field(self.reader, p + "model_digest"),
            layers=layers,
            experts=experts,
            manifest=list(_field(self.reader, p + "manifest")),
            leaves=leaves,
            kind=kind,
        )

    def expert_kinds(self, layer: int) -> tuple[str, ...]:
        """The stacked expert tensors of *layer*: gate/up/down, or a fused gate_up plus down."""
        return expert_kinds(self.has, layer)

    def expert_tensors(self, layer: int) -> tuple[str, ...]:
        """Every tensor of *layer* stacked by expert (weights, then the arch's expert biases): what a slice
        cuts along the expert axis and proves expert by expert."""
        return expert_tensor_names(self.cfg, self.has, layer)

    def _check_shapes(self) -> None:
        cfg = self.cfg
        want = expected_shapes(cfg)
        for i in cfg.moe_layers:
            if self.has(f"blk.{i}.{FUSED_GATE_UP}.weight"):
                e, ff, d = want.pop(f"blk.{i}.ffn_gate_exps.weight")
                del want[f"blk.{i}.ffn_up_exps.weight"]
                want[f"blk.{i}.{FUSED_GATE_UP}.weight"] = (e, 2 * ff, d)
        if cfg.spec.gdn_ssm_in:
            for i in range(cfg.n_layer):
                if cfg.is_recurrent(i) and self.has(f"blk.{i}.ssm_in.weight"):  # qwen3next's legacy input projection
                    del want[f"blk.{i}.attn_qkv.weight"], want[f"blk.{i}.attn_gate.weight"]
                    want[f"blk.{i}.ssm_in.weight"] = gdn_ssm_in_shape(cfg)
        if self.slice and self.slice.kind is Part.EXPERTS:
            n = len(self.experts)
            want = {name: (n, *want[name][1:]) for i in self.moe_layers for name in self.expert_tensors(i)}
        elif self.slice:  # the whole tensors of the part; which optional ones it must hold, its manifest says
            want = {name: want[name] for name in part_names(self.slice.kind, want, self.slice.layers)}
            if "output.weight" not in self.tensors and cfg.spec.tied_output_allowed:
                want.pop("output.weight", None)
        elif "output.weight" not in self.tensors and cfg.spec.tied_output_allowed:
            del want["output.weight"]
        optional = cfg.spec.optional_tensors
        unknown = [n for n in self.tensors if n not in want and not self._optional_mtp(n)]
        if unknown:  # llama.cpp refuses them too ("wrong number of tensors"); never compute without them silently
            raise ModelFormatError(f"tensor {unknown[0]} in {self.path} is not one moeswarm reads for {cfg.arch}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
        for name, shape in want.items():
            t = self.tensors.get(name)
            if t is None:
                if (name.split(".", 2)[-1] if name.startswith("blk.") else name) in optional and self.kind is not Part.EXPERTS:
                    continue
                raise ModelFormatError(f"tensor {name} is missing from {self.path} (arch {cfg.arch})")
            got = tuple(int(x) for x in reversed(t.shape))
            if got != shape:
                raise ModelFormatError(f"tensor {name} has shape {got}, expected {shape} from the metadata")
        if "token_embd.weight" in want and cfg.n_vocab != want["token_embd.weight"][0]:
            raise ModelFormatError(
                f"tokenizer.ggml.tokens has {cfg.n_vocab} tokens but token_embd.weight has {want['token_embd.weight'][0]} rows"
            )
        if cfg.spec.fused_qkv and cfg.q_dim != cfg.n_embd:
            raise ModelFormatError(f"{cfg.arch} needs n_head * head_dim == n_embd (llama.cpp sizes attn_qkv by n_embd); got {cfg.q_dim} != {cfg.n_embd}")
        if cfg.spec.mha_only and cfg.n_head_kv != cfg.n_head:
            raise ModelFormatError(f"{cfg.arch} needs as many KV heads as heads (llama.cpp sizes its K for n_head heads); got {cfg.n_head_kv} of {cfg.n_head}")

    def _optional_mtp(self, name: str) -> bool:
        """An MTP block's optional tensors (its own embedding / head): loaded by llama.cpp if present, never run."""
        parts = name.split(".", 2)
        return len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= self.cfg.n_layer and parts[2] in MTP_OPTIONAL

    # ---- tensors -----------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 memory-map view, outermost dim first (zero copy)."""
        t = self.tensors[name]
        shape = tuple(int(x) for x in reversed(t.shape))
        flat = self.reader.data[t.data_offset : t.data_offset + t.n_bytes]
        return flat.reshape(shape[0], -1) if len(shape) > 1 else flat

    def qtype(self, name: str) -> gguf.GGMLQuantizationType:
        return self.tensors[name].tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self.tensors[name].shape))

    def dense(self, name: str) -> np.ndarray:
        """Dequantize a whole tensor to float32 in numpy order (ne reversed)."""
        return dequantize_bytes(self.raw(name), self.qtype(name), self.shape(name))

    def expert_bytes(self, layer: int, kind: str, expert: int) -> np.ndarray:
        """One expert's contiguous, block-aligned bytes of a stacked expert tensor (zero copy)."""
        return self.expert_rows(f"blk.{layer}.{kind}.weight", expert)

    def expert_rows(self, name: str, expert: int) -> np.ndarray:
        """One expert's bytes of the stacked tensor *name* (weight or bias), zero copy."""
        layer = int(name.split(".")[1])
        if expert not in self.experts or (layer not in self.layers and layer not in self.mtp_layers):
            raise KeyError(f"expert {expert} of layer {layer} is not in {self.path}")
        return self.raw(name).reshape(self.shape(name)[0], -1)[expert - self.experts.start]

    def expert_biases(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """float32 (gate (ff,), up (ff,), down (d,)) biases of one expert, or None if the arch has none."""
        if not self.cfg.spec.expert_bias:
            return None
        g, u, d = (
            dequantize_bytes(self.expert_rows(f"blk.{layer}.{b}", expert), self.qtype(f"blk.{layer}.{b}"), self.shape(f"blk.{layer}.{b}")[1:])
            for b in EXPERT_BIASES
        )
        return g, u, d

    def expert_byte_range(self, layer: int, kind: str, expert: int) -> tuple[int, int]:
        """(file offset, length) of one expert inside its stacked tensor."""
        name = f"blk.{layer}.{kind}.weight"
        t = self.tensors[name]
        per = t.n_bytes // self.shape(name)[0]
        return t.data_offset + (expert - self.experts.start) * per, per

    def expert_weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dequantized (gate, up, down) of one expert: shapes (ff, d), (ff, d), (d, ff)."""
        mats = []
        for kind in self.expert_kinds(layer):
            name = f"blk.{layer}.{kind}.weight"
            mats.append(dequantize_bytes(self.expert_bytes(layer, kind, expert), self.qtype(name), self.shape(name)[1:]))
        if len(mats) == 2:  # fused gate_up: gate rows first, then up (llama.cpp's split)
            gate_up, down = mats
            ff = gate_up.shape[0] // 2
            return gate_up[:ff], gate_up[ff:], down
        return mats[0], mats[1], mats[2]

    # ---- identity ----------------------------------------------------------------------------

    @cached_property
    def digest(self) -> str:
        """The model's content digest; a slice reports the digest of the model it was cut from."""
        if self.slice:
            return self.slice.model_digest
        return model_digest(self.manifest)

    @cached_property
    def _entries(self) -> dict[str, tuple[str, list[str]]]:
        return _manifest_entries(self)

    @property
    def manifest(self) -> list[str]:
        """The config line, the tokenizer line, then one "name|type|shape|sha256" line per tensor, in file order."""
        return [config_line(self.cfg), tokenizer_line(self.tokenizer_blob)] + [line for line, _ in self._entries.values()]

    @cached_property
    def tokenizer_blob(self) -> bytes:
        """Every ``tokenizer.*`` key of the file as the canonical bytes the manifest hashes (:mod:`experts.parts`)."""
        return tokenizer_blob(tokenizer_fields(self.reader))

    @property
    def leaves(self) -> dict[str, list[str]]:
        """Per-expert sha256 of every stacked expert tensor."""
        return {name: lv for name, (_, lv) in self._entries.items() if lv}

    @cached_property
    def tokenizer_spec(self) -> TokenizerSpec:
        from .tokenizer import tokenizer_spec_from_reader

        return tokenizer_spec_from_reader(self.reader)


def dequantize_bytes(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize packed bytes to a float32 array of *shape* (numpy order)."""
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, gguf.quant_shape_to_byte_shape(shape, qtype)[-1])
    return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


def model_digest(manifest: list[str]) -> str:
    return hashlib.sha256("\n".join(manifest).encode()).hexdigest()


def expert_kinds(has: Callable[[str], bool], layer: int) -> tuple[str, ...]:
    """The stacked expert tensors of *layer* in a file whose tensor names *has* knows."""
    if has(f"blk.{layer}.{FUSED_GATE_UP}.weight"):
        return (FUSED_GATE_UP, "ffn_down_exps")
    return EXPERT_TENSORS


def expert_tensor_names(cfg: ModelConfig, has: Callable[[str], bool], layer: int) -> tuple[str, ...]:
    """The tensors of *layer* stacked by expert, in slice order; shared by a GGUF file and a manifest (a fetch
    writes a slice from a manifest alone, in the order a cut from the full file writes it)."""
    names = tuple(f"blk.{layer}.{kind}.weight" for kind in expert_kinds(has, layer))
    return names + (tuple(f"blk.{layer}.{b}" for b in EXPERT_BIASES) if cfg.spec.expert_bias else ())


def config_from_line(line: str) -> ModelConfig:
    """The inverse of :func:`config_line` (a manifest's first line); SliceError if it is not one."""
    prefix = "config|"
    try:
        if not line.startswith(prefix):
            raise ValueError("no config| prefix")
        cfg = ModelConfig(**json.loads(line[len(prefix) :]))
        arch_spec(cfg.arch)
    except (ValueError, TypeError, KeyError, ModelFormatError) as exc:
        raise SliceError(f"the manifest's config line is not one this version reads ({exc})") from None
    if config_line(cfg) != line:
        raise SliceError("the manifest's config line is not canonical")
    return cfg


def config_line(cfg: ModelConfig) -> str:
    """The hyper-parameters as one canonical line: two files with the same tensors but other
    metadata (say, a different top-k) compute different things and must not share a digest."""
    return "config|" + json.dumps(cfg.canonical(), sort_keys=True)


def tensor_hash(name: str, data: np.ndarray) -> tuple[str, list[str]]:
    """A tensor's manifest hash and leaves: sha256 of its bytes, or for stacked experts of its per-expert hashes."""
    if is_expert_tensor(name):
        leaves = [hashlib.sha256(memoryview(row)).hexdigest() for row in data.reshape(data.shape[0], -1)]
        return hashlib.sha256("".join(leaves).encode()).hexdigest(), leaves
    return hashlib.sha256(memoryview(np.ascontiguousarray(data))).hexdigest(), []


def _manifest_entries(model: GGUFModel) -> dict[str, tuple[str, list[str]]]:
    """One line per tensor: name|type|shape|sha256; for stacked experts the hash is over per-expert hashes.

    Hashing experts one by one (a Merkle list) lets a slice prove each expert it holds
    belongs to the model without shipping the rest of the model. Computed once per file
    and cached beside it, keyed by size and mtime, because it reads every byte.
    """
    cache = model.path.with_name(model.path.name + ".moeswarm-digest.json")
    st = model.path.stat()
    key = f"{st.st_size}:{st.st_mtime_ns}"
    if cache.exists():
        try:
            saved = json.loads(cache.read_text())
            if saved.get("key") == key:
                return {name: (line, lv) for name, line, lv in saved["entries"]}
        except (ValueError, KeyError, TypeError):
            pass
    entries = []
    for name, t in model.tensors.items():
        h, leaves = tensor_hash(name, model.raw(name))
        shape = "x".join(str(x) for x in model.shape(name))
        entries.append((name, f"{name}|{t.tensor_type.name}|{shape}|{h}", leaves))
    try:
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "entries": entries}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only model directory only costs recomputation
    return {name: (line, lv) for name, line, lv in entries}
