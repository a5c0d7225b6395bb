"""Slices: cut a part of a model out of it, prove where it came from, compute its experts (reference).

An expert slice is a GGUF holding only the stacked expert tensors of its layers,
cut along ne[2] to its expert range, in the original quantization (bytes copied,
never re-quantized), plus ``moeswarm.slice.*`` metadata: the source model's digest,
its manifest (one line per tensor) and the per-expert hashes of the sliced tensors.
A dense slice holds the other tensors of its layers whole, a head slice the embeddings,
output head and tokenizer keys (:mod:`experts.parts` says which tensor goes where).
Checking re-derives the model digest from the manifest and every expert's (or whole
tensor's) bytes against its hash, so a slice cannot claim a model it was not cut from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import structlog

from .config import ModelConfig
from .errors import SliceError
from .gguf_model import SLICE_PREFIX, ExpertRange, GGUFModel, config_line, model_digest, tensor_hash
from .kernels.reference import ReferenceKernel
from .model_writer import add_hparams
from .moe import Biases, ExpertSource, Glu, Progress
from .parts import Manifest, Part, TensorLine, TokenizerField, add_tokenizer_fields, parse_manifest, part_names, tokenizer_fields, tokenizer_line

log = structlog.get_logger("experts.slices")


def parse_range(text: str, limit: int, what: str) -> range:
    """'0-3' or '5' -> range, checked against [0, limit)."""
    try:
        a, _, b = text.partition("-")
        start, stop = int(a), int(b or a) + 1
    except ValueError:
        raise SliceError(f"{what} range {text!r} is not of the form N or N-M") from None
    if not 0 <= start < stop <= limit:
        raise SliceError(f"{what} range {text} is out of bounds: the model has {what}s 0-{limit - 1}")
    return range(start, stop)


@dataclass(frozen=True)
class SliceTensor:
    """One stacked expert tensor of a slice: its source model's type, shape (numpy order, experts first) and leaves."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    leaves: list[str]

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's rows in the file (block-aligned: rows are cut whole)."""
        return int(np.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)[1:]))


def write_slice(model: GGUFModel, layers: range, experts: ExpertRange, out: str | Path, *, progress_bar: bool = False) -> Path:
    """Write the slice (layers x experts) of a full model to *out* (*progress_bar*: gguf's own bar of the bytes
    written, on stderr: the CLI asks for it on a terminal only)."""
    if model.is_slice:
        raise SliceError(f"{model.path} is already a slice; cut slices from the full model")
    cfg = model.cfg
    if layers.start < 0 or layers.stop > cfg.n_layer or not layers:
        raise SliceError(f"layers {layers.start}-{layers.stop - 1} are out of bounds: the model has layers 0-{cfg.n_layer - 1}")
    if experts.stop > cfg.n_expert:
        raise SliceError(f"experts {experts} are out of bounds: the model has experts 0-{cfg.n_expert - 1}")
    if not any(cfg.is_moe(i) for i in layers):
        raise SliceError(f"layers {layers.start}-{layers.stop - 1} are all dense (no experts); MoE layers are {cfg.moe_layers[0]}-{cfg.moe_layers[-1]}")
    tensors = []
    for i in filter(cfg.is_moe, layers):  # dense layers in the range have nothing to slice
        for name in model.expert_tensors(i):  # weights and expert biases alike: cut by expert, proven by expert
            t = SliceTensor(name, model.qtype(name), model.shape(name), model.leaves[name])
            tensors.append((t, model.raw(name).reshape(t.shape[0], -1)[experts.start : experts.stop]))
    return write_slice_file(out, cfg, model.manifest, layers, experts, tensors, progress_bar=progress_bar)


def write_slice_file(out: str | Path, cfg: ModelConfig, manifest: list[str], layers: range, experts: ExpertRange, tensors: Sequence[tuple[SliceTensor, np.ndarray]], *, progress_bar: bool = False) -> Path:
    """The one writer of slice files: from a full model's memory map (:func:`write_slice`) or from experts fetched
    and verified piece by piece (:mod:`experts.slice_fetch`), so both give the same bytes. Each tensor comes with
    its experts' rows, shape (len(experts), bytes per expert)."""
    w = gguf.GGUFWriter(str(out), cfg.arch)
    add_hparams(w, cfg)
    p = SLICE_PREFIX
    w.add_string(p + "model_digest", model_digest(manifest))
    w.add_uint32(p + "layer_start", layers.start)
    w.add_uint32(p + "layer_stop", layers.stop)
    w.add_uint32(p + "expert_start", experts.start)
    w.add_uint32(p + "expert_stop", experts.stop)
    w.add_array(p + "manifest", manifest)
    leaves = {}
    for t, rows in tensors:
        leaves[t.name] = t.leaves
        byte_shape = gguf.quant_shape_to_byte_shape((len(experts), *t.shape[1:]), t.qtype)
        w.add_tensor(t.name, np.ascontiguousarray(rows).reshape(byte_shape), raw_shape=byte_shape, raw_dtype=t.qtype)
    w.add_string(p + "leaves", json.dumps(leaves))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=progress_bar)
    w.close()
    return Path(out)


def write_part_slice(model: GGUFModel, part: Part, layers: range = range(0), out: str | Path = "", *, progress_bar: bool = False) -> Path:
    """Write the dense slice of *layers*, or the head slice, of a full model to *out* (tensors whole, bytes copied)."""
    if model.is_slice:
        raise SliceError(f"{model.path} is already a slice; cut slices from the full model")
    cfg = model.cfg
    if part is Part.DENSE and (layers.start < 0 or layers.stop > cfg.n_layer or not layers):
        raise SliceError(f"layers {layers.start}-{layers.stop - 1} are out of bounds: the model has layers 0-{cfg.n_layer - 1}")
    manifest = model.manifest
    lines = parse_manifest(manifest).tensors
    tensors = [(name, lines[name], model.raw(name)) for name in part_names(part, model.tensors, layers)]
    tokenizer = tokenizer_fields(model.reader) if part is Part.HEAD else None
    return write_part_file(out, cfg, manifest, part, layers, tensors, tokenizer, progress_bar=progress_bar)


def write_part_file(out: str | Path, cfg: ModelConfig, manifest: list[str], part: Part, layers: range, tensors: Sequence[tuple[str, TensorLine, np.ndarray]], tokenizer: Sequence[TokenizerField] | None, *, progress_bar: bool = False) -> Path:
    """The one writer of dense and head slices: from a full model's map (:func:`write_part_slice`) or from tensors
    fetched and verified (:mod:`experts.slice_fetch`), so both give the same bytes."""
    w = gguf.GGUFWriter(str(out), cfg.arch)
    add_hparams(w, cfg)
    p = SLICE_PREFIX
    w.add_string(p + "model_digest", model_digest(manifest))
    w.add_string(p + "kind", part.value)
    if part is Part.DENSE:
        w.add_uint32(p + "layer_start", layers.start)
        w.add_uint32(p + "layer_stop", layers.stop)
    w.add_array(p + "manifest", manifest)
    w.add_string(p + "leaves", "{}")
    if tokenizer is not None:
        add_tokenizer_fields(w, tokenizer)
    for name, line, data in tensors:
        byte_shape = gguf.quant_shape_to_byte_shape(line.shape, line.qtype)
        w.add_tensor(name, np.ascontiguousarray(data).reshape(byte_shape), raw_shape=byte_shape, raw_dtype=line.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=progress_bar)
    w.close()
    return Path(out)


def check_slice(sl: GGUFModel, expected_digest: str | None = None, progress: Progress | None = None) -> None:
    """Prove the slice's bytes belong to the model it names (and, if given, that this is *expected_digest*);
    *progress* hears after each layer (each tensor of a dense or head slice)."""
    info = sl.slice
    if info is None:
        raise SliceError(f"{sl.path} is not a slice file")
    if expected_digest is not None and info.model_digest != expected_digest:
        raise SliceError(
            f"slice {sl.path} was cut from model {info.model_digest[:16]}..., not from {expected_digest[:16]}...; "
            "use a slice of the model you serve"
        )
    if model_digest(info.manifest) != info.model_digest:
        raise SliceError(f"slice {sl.path}: its manifest does not hash to the model digest it claims (tampered metadata)")
    manifest = parse_manifest(info.manifest)
    if manifest.config_line != config_line(sl.cfg):
        raise SliceError(f"slice {sl.path}: its hyper-parameters differ from those of model {info.model_digest[:16]}...")
    if info.kind is not Part.EXPERTS:
        _check_whole(sl, manifest, progress)
        return
    manifest_hash = {name: line.sha256 for name, line in manifest.tensors.items()}
    for done, i in enumerate(sl.moe_layers, 1):
        for name in sl.expert_tensors(i):
            leaves = info.leaves.get(name)
            if leaves is None or hashlib.sha256("".join(leaves).encode()).hexdigest() != manifest_hash.get(name):
                raise SliceError(f"slice {sl.path}: tensor {name} is not part of model {info.model_digest[:16]}...")
            for e in range(sl.experts.start, sl.experts.stop):
                if hashlib.sha256(sl.expert_rows(name, e).data).hexdigest() != leaves[e]:
                    raise SliceError(f"slice {sl.path}: expert {e} of {name} does not match the model's bytes")
        if progress:
            progress(done, len(sl.moe_layers))


def _check_whole(sl: GGUFModel, manifest: Manifest, progress: Progress | None) -> None:
    """A dense or head slice: every tensor the manifest has of its part (an optional one the model has included), each
    whole and the model's bytes, and for a head slice the model's tokenizer keys."""
    info = sl.slice
    assert info is not None
    model = f"model {info.model_digest[:16]}..."
    if info.kind is Part.DENSE and (not info.layers or info.layers.stop > sl.cfg.n_layer):
        raise SliceError(f"slice {sl.path}: layers {info.layers.start}-{info.layers.stop - 1} are not trunk layers of {model}")
    names = part_names(info.kind, manifest.tensors, info.layers)  # GGUFModel refused any other tensor at open
    if missing := [n for n in names if n not in sl.tensors]:
        raise SliceError(f"slice {sl.path} lacks tensor {missing[0]} of {model}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for done, name in enumerate(names, 1):
        line = manifest.tensors[name]
        if sl.qtype(name) != line.qtype or sl.shape(name) != line.shape or tensor_hash(name, sl.raw(name))[0] != line.sha256:
            raise SliceError(f"slice {sl.path}: tensor {name} does not match the bytes of {model}")
        if progress:
            progress(done, len(names))
    if info.kind is Part.HEAD and tokenizer_line(sl.tokenizer_blob) != info.manifest[1]:
        raise SliceError(f"slice {sl.path}: its tokenizer metadata is not that of {model}")


def hosted_part(model: GGUFModel, layers: range | None, experts: ExpertRange | None) -> tuple[range, ExpertRange]:
    """The layers x experts a node hosts (default: all the file has), refused unless *model* holds them.

    The trunk's layers, or a full file's MTP blocks (which a backbone drafting with them computes itself)."""
    layers = layers if layers is not None else model.layers
    experts = experts or model.experts
    if not any(outer.start <= layers.start and layers.stop <= outer.stop for outer in (model.layers, model.mtp_layers)):
        raise SliceError(f"layers {layers.start}-{layers.stop - 1} are not in {model.path} (it has {model.layers.start}-{model.layers.stop - 1})")
    if experts.start < model.experts.start or experts.stop > model.experts.stop:
        raise SliceError(f"experts {experts} are not in {model.path} (it has {model.experts})")
    return layers, experts


class HostedExperts(ExpertSource):
    """What every source of a GGUF file's hosted experts answers the same way, whatever kernel computes them."""

    def holds(self, layer: int, expert: int) -> bool:
        return layer in self.layers and self.model.cfg.is_moe(layer) and expert in self.experts

    def glu(self, layer: int) -> Glu:
        return self.model.cfg.glu_exp(layer)

    def biases(self, layer: int, expert: int) -> Biases | None:
        if not self.holds(layer, expert):
            raise SliceError(f"expert {expert} of layer {layer} is not hosted here")
        return self.model.expert_biases(layer, expert)


class ExpertStore(HostedExperts):
    """The experts a node hosts, from a full model or a slice, through the numpy reference numerics.

    With *cache* it keeps each expert dequantized to float32 after its first use ("cached";
    :meth:`warm` fills it up front, ~7x a Q4_K file); otherwise it keeps only the quantized
    memory map and dequantizes per call ("on-the-fly": slower, the packed size in memory).
    Its bits are ``ReferenceKernel``'s; :mod:`experts.hosting` decides when to use it.
    """

    identity = ReferenceKernel.identity

    def __init__(self, model: GGUFModel, layers: range | None = None, experts: ExpertRange | None = None, *, cache: bool = True) -> None:
        self.model = model
        self.layers, self.experts = hosted_part(model, layers, experts)
        self.mode = "cached" if cache else "on-the-fly"
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        log.debug("experts.opened", path=str(model.path), layers=f"{self.layers.start}-{self.layers.stop - 1}", experts=str(self.experts), mode=self.mode)

    def weights(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.holds(layer, expert):
            raise SliceError(f"expert {expert} of layer {layer} is not hosted here")
        cached = self._cache.get((layer, expert))
        if cached is None:
            cached = self.model.expert_weights(layer, expert)
            if self.mode == "cached":
                self._cache[(layer, expert)] = cached
        return cached

    def warm(self, progress: Progress | None = None) -> None:
        """Dequantize every hosted expert now (cached mode), so the first dispatches pay nothing."""
        if self.mode == "cached":
            steps = [(i, e) for i in filter(self.model.cfg.is_moe, self.layers) for e in range(self.experts.start, self.experts.stop)]
            for done, (i, e) in enumerate(steps, 1):
                self.weights(i, e)
                if progress:
                    progress(done, len(steps))
