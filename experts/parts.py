"""Which part of a model each tensor belongs to, and the tokenizer as one hashed blob: what dense and head slices cut.

A model splits into three kinds of slice, so that no node needs the whole file (issue 26):

* ``experts`` — the stacked routed-expert tensors of some layers, cut along the expert axis (a worker);
* ``dense`` — everything else of some trunk layers (attention, norms, router, shared expert, a dense layer's FFN,
  whatever the arch has), plus the model-wide tensors those layers read (``rope_freqs.weight``) (a stage);
* ``head`` — the embeddings, output norm, output head, and the tokenizer metadata (a client).

The split is by the file's own tensor names, never a hand list per arch: ``blk.N.*`` belongs to layer N (its stacked
``*_exps`` tensors to the experts), and of the model-wide tensors gguf-py's table names the head ones
(``token_embd``, ``token_embd_norm``, ``output_norm``, ``output``); any other model-wide tensor goes with every dense
slice. The same functions run on a GGUF file's tensor names (cutting) and on a manifest's (fetching), in manifest
order, so a fetched slice is byte for byte the cut one.

The tokenizer metadata (every ``tokenizer.*`` key) is hashed as one canonical blob whose size and sha256 are the
manifest's ``tokenizer|SIZE|SHA256`` line: without it a head slice's vocabulary could be swapped under an unchanged
digest. MTP (nextn) blocks after the trunk belong to no slice yet (a full file keeps them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import gguf

from .errors import SliceError

TOKENIZER_PREFIX = "tokenizer."
TOKENIZER_ITEM = "@tokenizer"  # the blob's name in a fetch (no tensor name starts with '@')
_HEAD_STEMS = frozenset(gguf.TENSOR_NAMES[t] for t in (gguf.MODEL_TENSOR.TOKEN_EMBD, gguf.MODEL_TENSOR.TOKEN_EMBD_NORM, gguf.MODEL_TENSOR.OUTPUT_NORM, gguf.MODEL_TENSOR.OUTPUT))
V = gguf.GGUFValueType


class Part(StrEnum):
    EXPERTS = "experts"
    DENSE = "dense"
    HEAD = "head"


def is_expert_tensor(name: str) -> bool:
    """Stacked by expert, so hashed expert by expert (a Merkle list): the weights and their biases."""
    return name.endswith(("_exps.weight", "_exps.bias"))


def block_of(name: str) -> int | None:
    """The layer of a ``blk.N.*`` tensor, None for a model-wide one."""
    parts = name.split(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else None


def is_head_tensor(name: str) -> bool:
    return block_of(name) is None and name.rsplit(".", 1)[0] in _HEAD_STEMS


def head_names(names: Iterable[str]) -> list[str]:
    """The head slice's tensors among *names*, in their order."""
    return [n for n in names if is_head_tensor(n)]


def dense_names(names: Iterable[str], layers: range) -> list[str]:
    """The dense slice's tensors of *layers* among *names*, in their order: the layers' non-expert tensors and every
    model-wide tensor that is not the head's (the layers' attention reads them)."""
    out = []
    for n in names:
        layer = block_of(n)
        if (layer is None and not is_head_tensor(n)) or (layer in layers and not is_expert_tensor(n)):
            out.append(n)
    return out


def part_names(part: Part, names: Iterable[str], layers: range) -> list[str]:
    """The whole (uncut) tensors a dense or head slice of *layers* holds."""
    if part is Part.HEAD:
        return head_names(names)
    if part is Part.DENSE:
        return dense_names(names, layers)
    raise ValueError("an expert slice cuts its tensors by expert; it holds no whole tensor")


# ---- the tokenizer blob ----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerField:
    """One ``tokenizer.*`` key as the file types it: [type] for a scalar, [ARRAY, item type] for an array."""

    key: str
    types: tuple[int, ...]
    value: object


def tokenizer_fields(reader: gguf.GGUFReader) -> list[TokenizerField]:
    """The file's tokenizer keys, sorted (a slice written elsewhere may store them in another order)."""
    fields = [f for f in reader.fields.values() if f.name.startswith(TOKENIZER_PREFIX)]
    return [TokenizerField(f.name, tuple(int(t) for t in f.types), f.contents()) for f in sorted(fields, key=lambda f: f.name)]


def tokenizer_blob(fields: Iterable[TokenizerField]) -> bytes:
    """The canonical bytes the manifest's tokenizer line hashes (JSON: floats of float32 round-trip exactly)."""
    return json.dumps([[f.key, list(f.types), f.value] for f in fields], separators=(",", ":"), ensure_ascii=True).encode()


def tokenizer_line(blob: bytes) -> str:
    return f"tokenizer|{len(blob)}|{hashlib.sha256(blob).hexdigest()}"


def fields_from_blob(blob: bytes) -> list[TokenizerField]:
    """The inverse of :func:`tokenizer_blob` (on bytes already checked against the manifest's hash)."""
    try:
        items = json.loads(blob)
        fields = [TokenizerField(str(k), tuple(int(t) for t in types), value) for k, types, value in items]
    except (ValueError, TypeError) as exc:
        raise SliceError(f"the tokenizer blob does not decode ({exc})") from None
    if tokenizer_blob(fields) != blob:
        raise SliceError("the tokenizer blob is not canonical")
    return fields


def add_tokenizer_fields(w: gguf.GGUFWriter, fields: Iterable[TokenizerField]) -> None:
    """Write the keys back with the types the source file gave them (so the slice's blob hashes the same)."""
    for f in fields:
        vtype = V(f.types[0])
        if vtype is V.ARRAY:
            if len(f.types) != 2 or V(f.types[1]) is V.ARRAY:
                raise SliceError(f"tokenizer key {f.key} is a nested array; a head slice cannot carry it")
            w.add_key_value(f.key, f.value, vtype, sub_type=V(f.types[1]))
        else:
            w.add_key_value(f.key, f.value, vtype)


# ---- the manifest ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorLine:
    """One tensor's manifest line: its type, numpy shape and hash (of its bytes, or of its experts' leaves)."""

    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    sha256: str

    @property
    def nbytes(self) -> int:
        return int(_prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)))


@dataclass(frozen=True)
class Manifest:
    """A manifest parsed: the config line, the tokenizer blob's size and hash, and the tensors in file order."""

    config_line: str
    tokenizer_nbytes: int
    tokenizer_sha256: str
    tensors: dict[str, TensorLine]


def parse_manifest(lines: list[str]) -> Manifest:
    """SliceError unless *lines* is a manifest: ``config|...``, ``tokenizer|SIZE|SHA``, then ``name|type|shape|sha``."""
    if len(lines) < 2:
        raise SliceError("the manifest has no config and tokenizer lines")
    tok = lines[1].split("|")
    if len(tok) != 3 or tok[0] != "tokenizer" or not tok[1].isdigit():
        raise SliceError(f"the manifest's second line is not a tokenizer line: {lines[1][:80]!r}")
    tensors = {}
    for line in lines[2:]:
        try:
            name, qtype, shape, h = line.split("|")
            tensors[name] = TensorLine(gguf.GGMLQuantizationType[qtype], tuple(int(x) for x in shape.split("x")), h)
        except (ValueError, KeyError):
            raise SliceError(f"manifest line {line[:80]!r} is not name|type|shape|sha256") from None
    return Manifest(lines[0], int(tok[1]), tok[2], tensors)


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for x in shape:
        out *= int(x)
    return out
