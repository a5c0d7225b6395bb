"""Open a GGUF MoE model (or a slice of one) and check it is complete and consistent.

Everything is memory-mapped by gguf-py's reader: opening a 30 GB model reads only
its header, and an expert's weights are read by slicing the mapped tensor along
its outermost dimension (ggml ne[2]), which touches only that expert's pages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import gguf
import numpy as np

from .arch import EXPERT_BIASES, EXPERT_TENSORS, FUSED_GATE_UP, MTP_OPTIONAL
from .archs import arch_spec
from .archs.gdn import GatedDeltaNet, ssm_in_shape
from .archs.keys import Keys
from .archs.keys import field as _field
from .atomic import write_atomic
from .config import ModelConfig, TokenizerSpec
from .errors import ModelFormatError, SliceError
from .model_writer import expected_shapes
from .parts import Part, is_expert_tensor, part_names, tokenizer_blob, tokenizer_fields, tokenizer_line

SLICE_PREFIX = "moeswarm.slice."


@dataclass(frozen=True)
class ExpertRange:
    """A half-open range of expert indices [start, stop)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"empty or negative expert range {self.start}..{self.stop}")

    def __contains__(self, e: object) -> bool:
        return isinstance(e, (int, np.integer)) and bool(self.start <= e < self.stop)

    def __len__(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"{self.start}-{self.stop - 1}"


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    """The hyper-parameters of a GGUF file, read by its arch's family module (:mod:`experts.archs`)."""
    arch = _field(reader, "general.architecture")
    return ModelConfig(arch=arch, **arch_spec(arch).read(Keys(reader, arch)))


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
        attention = cfg.spec.attention
        if isinstance(attention, GatedDeltaNet) and attention.ssm_in:
            for i in range(cfg.n_layer):
                if cfg.is_recurrent(i) and self.has(f"blk.{i}.ssm_in.weight"):  # qwen3next's legacy input projection
                    del want[f"blk.{i}.attn_qkv.weight"], want[f"blk.{i}.attn_gate.weight"]
                    want[f"blk.{i}.ssm_in.weight"] = ssm_in_shape(cfg)
        if self.slice and self.slice.kind is Part.EXPERTS:
            n = len(self.experts)
            want = {name: (n, *want[name][1:]) for i in self.moe_layers for name in self.expert_tensors(i)}
        elif self.slice:  # the whole tensors of the part; which optional ones it must hold, its manifest says
            want = {name: want[name] for name in part_names(self.slice.kind, want, self.slice.layers)}
            if "output.weight" not in self.tensors and cfg.spec.tied_output:
                want.pop("output.weight", None)
        elif "output.weight" not in self.tensors and cfg.spec.tied_output:
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
        cfg.spec.check(cfg)

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
        if not self.cfg.spec.experts.biases:
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
    return names + (tuple(f"blk.{layer}.{b}" for b in EXPERT_BIASES) if cfg.spec.experts.biases else ())


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
        leaves = [hashlib.sha256(row.data).hexdigest() for row in data.reshape(data.shape[0], -1)]
        return hashlib.sha256("".join(leaves).encode()).hexdigest(), leaves
    return hashlib.sha256(np.ascontiguousarray(data).data).hexdigest(), []


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
        write_atomic(cache, json.dumps({"key": key, "entries": entries}))
    except OSError:
        pass  # a read-only model directory only costs recomputation
    return {name: (line, lv) for name, line, lv in entries}
