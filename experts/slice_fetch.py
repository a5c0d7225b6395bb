"""Fetching a slice from peers, sans-IO: what to fetch, from whom, and whether what arrived is the model's.

Expert slices come expert by expert; dense and head slices tensor by tensor (whole, as "expert 0"), the head's
tokenizer keys as one blob named ``@tokenizer``: a whole piece's hash is its manifest line, so no holder's leaves
are needed for it, and a holder's SliceInfo listing a whole tensor with that one leaf is how it says it serves it.

The trust root is the model digest alone. A holder's manifest is used only if it hashes to that digest; a tensor's
per-expert leaves only if they hash to the manifest's line for it; an expert's bytes only if they hash to its leaf.
So a holder can waste our time but never put a byte of another model into the slice: a bad expert drops that holder
(:meth:`FetchPlan.received`) and the expert goes back to the queue for another holder.

Verified experts are staged one file each, named by their leaf, before the slice is written; a restarted fetch
re-hashes what is staged and fetches only the rest. The slice is then written by :func:`experts.slices.write_slice_file`
- the writer ``moeswarm slice`` uses - so it is byte for byte what a cut from the full model gives.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from .atomic import write_atomic
from .config import ModelConfig
from .errors import SliceError
from .gguf_model import ExpertRange, config_from_line, expert_tensor_names, model_digest
from .parts import TOKENIZER_ITEM, Manifest, Part, TensorLine, block_of, fields_from_blob, parse_manifest, part_names
from .slices import SliceTensor, write_part_file, write_slice_file

log = structlog.get_logger("experts.slice_fetch")
MAX_STRIKES = 3  # timeouts or refusals before a holder is dropped (one bad piece drops it at once)


class OutsideModel(SliceError):
    """The requested layers or experts are not in the model (the request is wrong, not the holder that said so)."""


@dataclass(frozen=True)
class ExpertRows:
    """The unit fetched, verified and staged: one expert's rows of one stacked tensor, or (*whole*) a dense or head
    slice's tensor (or the tokenizer blob), asked for as expert 0."""

    name: str
    layer: int  # -1: a model-wide tensor or the tokenizer blob
    expert: int
    nbytes: int
    leaf: str  # its sha256, from the verified leaves (a whole tensor: its manifest line)
    whole: bool = False


@dataclass
class SliceLayout:
    """The slice (layers x experts, or a dense or head *part*) of the model named by *digest*, as far as a verified
    manifest says."""

    digest: str
    cfg: ModelConfig
    manifest: list[str]
    layers: range
    experts: ExpertRange | None  # None: a dense or head slice
    part: Part = Part.EXPERTS
    tensors: dict[str, SliceTensor] = field(default_factory=dict)  # filled by accept_leaves, in slice order
    _parsed: Manifest | None = field(default=None, repr=False)

    @classmethod
    def from_manifest(cls, digest: str, manifest: Iterable[str], layers: range, experts: ExpertRange | None, part: Part = Part.EXPERTS) -> SliceLayout:
        """SliceError unless *manifest* is the one *digest* names and the range is inside the model."""
        manifest = list(manifest)
        if model_digest(manifest) != digest:
            raise SliceError(f"the manifest does not hash to model {digest[:16]}... (a holder of another model, or forged)")
        parsed = parse_manifest(manifest)
        cfg = config_from_line(parsed.config_line)
        if part is Part.HEAD:
            return cls(digest, cfg, manifest, range(0), None, part, _parsed=parsed)
        if not layers or layers.start < 0 or layers.stop > cfg.n_layer:
            raise OutsideModel(f"layers {layers.start}-{layers.stop - 1} are out of bounds: the model has layers 0-{cfg.n_layer - 1}")
        if part is Part.DENSE:
            return cls(digest, cfg, manifest, layers, None, part, _parsed=parsed)
        if experts is None or experts.stop > cfg.n_expert:
            raise OutsideModel(f"experts {experts} are out of bounds: the model has experts 0-{cfg.n_expert - 1}")
        if not any(cfg.is_moe(i) for i in layers):
            raise OutsideModel(f"layers {layers.start}-{layers.stop - 1} are all dense (no experts)")
        return cls(digest, cfg, manifest, layers, experts, part, _parsed=parsed)

    @classmethod
    def whole(cls, digest: str, manifest: Iterable[str]) -> SliceLayout:
        """Every layer and expert of the model (its shape and sizes, before a part of it is chosen)."""
        manifest = list(manifest)
        if not manifest or model_digest(manifest) != digest:
            raise SliceError(f"the manifest does not hash to model {digest[:16]}... (a holder of another model, or forged)")
        cfg = config_from_line(manifest[0])
        return cls.from_manifest(digest, manifest, range(cfg.n_layer), ExpertRange(0, cfg.n_expert))

    @property
    def _lines(self) -> dict[str, TensorLine]:
        assert self._parsed is not None
        return self._parsed.tensors

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of *layer* (its rows of every stacked tensor), as the manifest's types and shapes say."""
        return sum(self._lines[name].nbytes // self._lines[name].shape[0] for name in expert_tensor_names(self.cfg, self._lines.__contains__, layer))

    @property
    def names(self) -> list[str]:
        """The slice's tensors in file order (the order :func:`experts.slices.write_slice` or
        :func:`experts.slices.write_part_slice` writes them)."""
        if self.part is not Part.EXPERTS:
            return part_names(self.part, self._lines, self.layers)
        return [n for i in filter(self.cfg.is_moe, self.layers) for n in expert_tensor_names(self.cfg, self._lines.__contains__, i)]

    def whole_leaf(self, name: str) -> str | None:
        """The hash a holder advertising *name* whole must give (a dense or head slice's tensor, the tokenizer blob)."""
        if self.part is Part.EXPERTS:
            return None
        assert self._parsed is not None
        if name == TOKENIZER_ITEM:
            return self._parsed.tokenizer_sha256 if self.part is Part.HEAD else None
        return self._lines[name].sha256 if name in self.names else None

    def accept_leaves(self, name: str, leaves: Iterable[str]) -> bool:
        """Keep *leaves* for tensor *name* if they are the manifest's (False: not a slice tensor, or forged)."""
        leaves = list(leaves)
        if self.part is not Part.EXPERTS:
            return (want := self.whole_leaf(name)) is not None and leaves == [want]
        line = self._lines.get(name)
        if line is None or name not in self.names or hashlib.sha256("".join(leaves).encode()).hexdigest() != line.sha256:
            return False
        if len(leaves) != line.shape[0]:
            return False
        self.tensors.setdefault(name, SliceTensor(name, line.qtype, line.shape, leaves))
        return True

    @property
    def missing_leaves(self) -> list[str]:
        return [n for n in self.names if n not in self.tensors] if self.part is Part.EXPERTS else []

    def items(self) -> list[ExpertRows]:
        """Every (tensor, expert) the slice needs (all leaves must be known), or every whole tensor."""
        if self.part is not Part.EXPERTS:
            assert self._parsed is not None
            whole = [ExpertRows(n, _layer_or_none(n), 0, self._lines[n].nbytes, self._lines[n].sha256, True) for n in self.names]
            if self.part is Part.HEAD:
                whole.append(ExpertRows(TOKENIZER_ITEM, -1, 0, self._parsed.tokenizer_nbytes, self._parsed.tokenizer_sha256, True))
            return whole
        if missing := self.missing_leaves:
            raise SliceError(f"no holder gave valid leaves for {missing[0]} (and {len(missing) - 1} more tensors)")
        assert self.experts is not None
        return [
            ExpertRows(n, int(n.split(".")[1]), e, self.tensors[n].expert_nbytes, self.tensors[n].leaves[e])
            for n in self.names
            for e in range(self.experts.start, self.experts.stop)
        ]

    def write(self, out: Path, staging: Staging) -> Path:
        """Write the slice from the staged pieces (each re-read from its verified file)."""
        tmp = out.with_name(out.name + ".tmp")
        if self.part is not Part.EXPERTS:
            tensors = [(n, self._lines[n], staging.read(self._lines[n].sha256, self._lines[n].nbytes)) for n in self.names]
            tokenizer = None
            if self.part is Part.HEAD:
                assert self._parsed is not None
                tokenizer = fields_from_blob(staging.read(self._parsed.tokenizer_sha256, self._parsed.tokenizer_nbytes).tobytes())
            write_part_file(tmp, self.cfg, self.manifest, self.part, self.layers, tensors, tokenizer)
        else:
            assert self.experts is not None
            experts = self.experts
            parts = []
            for name in self.names:
                t = self.tensors[name]
                rows = np.stack([staging.read(t.leaves[e], t.expert_nbytes) for e in range(experts.start, experts.stop)])
                parts.append((t, rows))
            write_slice_file(tmp, self.cfg, self.manifest, self.layers, experts, parts)
        os.replace(tmp, out)
        return out


def _layer_or_none(name: str) -> int:
    layer = block_of(name)
    return -1 if layer is None else layer


class Staging:
    """Verified experts on disk, one file each named by its leaf (``SLICE.gguf.parts/``), written atomically."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, leaf: str) -> Path:
        return self.dir / f"{leaf}.bin"

    def verified(self, items: Iterable[ExpertRows]) -> set[ExpertRows]:
        """The items already staged whose bytes still hash to their leaf (a torn or altered file is deleted)."""
        done = set()
        for item in items:
            p = self.path(item.leaf)
            if p.exists():
                if hashlib.sha256(p.read_bytes()).hexdigest() == item.leaf:
                    done.add(item)
                else:
                    p.unlink()
        return done

    def write(self, item: ExpertRows, data: bytes) -> None:
        """Atomic by rename, not fsynced: a killed process loses nothing written, and after a power cut a torn file
        fails its hash on resume (:meth:`verified`) and is fetched again. Files are named by content, so two items
        with the same bytes (two equal norm tensors) are one file that two lanes may write at once: hence
        :func:`write_atomic`, whose every writer has a temporary name of its own."""
        write_atomic(self.path(item.leaf), data)

    def read(self, leaf: str, nbytes: int) -> np.ndarray:
        data = np.fromfile(self.path(leaf), dtype=np.uint8)
        if data.size != nbytes:
            raise SliceError(f"staged expert {leaf[:16]}... has {data.size} bytes, not {nbytes}")
        return data

    def remove(self) -> None:
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()


@dataclass
class Holder:
    """A peer that says it serves (layers x experts) of the model, and these *whole* tensors, as its SliceInfo says."""

    peer: str
    layers: range
    experts: range
    strikes: int = 0
    whole: frozenset[str] = frozenset()

    def has(self, item: ExpertRows) -> bool:
        if item.whole:
            return item.name in self.whole
        return item.layer in self.layers and item.expert in self.experts


@dataclass
class FetchPlan:
    """Which expert to ask which holder for next, and what a holder's answer does to the plan.

    Pure state: the caller fetches, reports with :meth:`received` or :meth:`failed`, and stops when
    :attr:`finished`, or when :meth:`stuck` names an expert no live holder has.
    """

    items: list[ExpertRows]
    done: set[ExpertRows] = field(default_factory=set)
    holders: dict[str, Holder] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # peer -> why
    on_drop: Callable[[str, str], None] | None = None
    _busy: dict[ExpertRows, str] = field(default_factory=dict)
    fetched_bytes: int = 0  # verified bytes received from holders (not what was staged before a restart)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def done_bytes(self) -> int:
        return sum(i.nbytes for i in self.done)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.items)

    def add_holder(self, holder: Holder) -> None:
        if holder.peer not in self.dropped:
            self.holders[holder.peer] = holder

    def take(self, peer: str) -> ExpertRows | None:
        """The next expert *peer* holds that is neither done nor being fetched (None: nothing for it now)."""
        holder = self.holders.get(peer)
        if holder is None:
            return None
        for item in self.items:
            if item not in self.done and item not in self._busy and holder.has(item):
                self._busy[item] = peer
                return item
        return None

    def could_serve(self, peer: str) -> bool:
        """Whether *peer* may still get work: it is live and holds an expert not yet done."""
        holder = self.holders.get(peer)
        return holder is not None and any(i not in self.done and holder.has(i) for i in self.items)

    def received(self, peer: str, item: ExpertRows, data: bytes) -> bool:
        """True if *data* is the expert's bytes; else the holder is dropped and the expert queued again."""
        self._busy.pop(item, None)
        if len(data) == item.nbytes and hashlib.sha256(data).hexdigest() == item.leaf:
            self.done.add(item)
            self.fetched_bytes += len(data)
            return True
        self.drop(peer, f"sent bytes for expert {item.expert} of {item.name} that do not match the model's leaf")
        return False

    def failed(self, peer: str, item: ExpertRows, reason: str, *, strike: bool = True) -> None:
        """The request for *item* got no usable answer (timeout, refusal): queue it again; strikes drop the holder
        (a busy holder gets none: it asked us to come back later)."""
        self._busy.pop(item, None)
        holder = self.holders.get(peer)
        if holder is not None and strike:
            holder.strikes += 1
            if holder.strikes >= MAX_STRIKES:
                self.drop(peer, f"{holder.strikes} failed requests, the last: {reason}")

    def drop(self, peer: str, why: str) -> None:
        if self.holders.pop(peer, None) is not None:
            self.dropped[peer] = why
            for item, p in list(self._busy.items()):
                if p == peer:
                    del self._busy[item]
            log.warning("fetch.holder_dropped", peer=peer, reason=why)
            if self.on_drop:
                self.on_drop(peer, why)

    def stuck(self) -> ExpertRows | None:
        """An expert not done that no live holder has (the fetch cannot finish), if any."""
        for item in self.items:
            if item not in self.done and not any(h.has(item) for h in self.holders.values()):
                return item
        return None
