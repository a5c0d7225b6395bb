"""Fetching a slice from peers, sans-IO: what to fetch, from whom, and whether what arrived is the model's.

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

import gguf
import numpy as np
import structlog

from .config import ModelConfig
from .errors import SliceError
from .gguf_model import ExpertRange, config_from_line, expert_tensor_names, model_digest
from .slices import SliceTensor, write_slice_file

log = structlog.get_logger("experts.slice_fetch")
MAX_STRIKES = 3  # timeouts or refusals before a holder is dropped (one bad piece drops it at once)


class OutsideModel(SliceError):
    """The requested layers or experts are not in the model (the request is wrong, not the holder that said so)."""


@dataclass(frozen=True)
class ExpertRows:
    """One expert's rows of one stacked tensor: the unit fetched, verified and staged."""

    name: str
    layer: int
    expert: int
    nbytes: int
    leaf: str  # its sha256, from the verified leaves


@dataclass
class SliceLayout:
    """The slice (layers x experts) of the model named by *digest*, as far as a verified manifest says."""

    digest: str
    cfg: ModelConfig
    manifest: list[str]
    layers: range
    experts: ExpertRange
    tensors: dict[str, SliceTensor] = field(default_factory=dict)  # filled by accept_leaves, in slice order
    _lines: dict[str, tuple[gguf.GGMLQuantizationType, tuple[int, ...], str]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_manifest(cls, digest: str, manifest: Iterable[str], layers: range, experts: ExpertRange) -> SliceLayout:
        """SliceError unless *manifest* is the one *digest* names and the range is inside the model."""
        manifest = list(manifest)
        if model_digest(manifest) != digest:
            raise SliceError(f"the manifest does not hash to model {digest[:16]}... (a holder of another model, or forged)")
        cfg = config_from_line(manifest[0])
        lines = {}
        for line in manifest[1:]:
            name, qtype, shape, h = line.split("|")
            lines[name] = (gguf.GGMLQuantizationType[qtype], tuple(int(x) for x in shape.split("x")), h)
        if not layers or layers.start < 0 or layers.stop > cfg.n_layer:
            raise OutsideModel(f"layers {layers.start}-{layers.stop - 1} are out of bounds: the model has layers 0-{cfg.n_layer - 1}")
        if experts.stop > cfg.n_expert:
            raise OutsideModel(f"experts {experts} are out of bounds: the model has experts 0-{cfg.n_expert - 1}")
        if not any(cfg.is_moe(i) for i in layers):
            raise OutsideModel(f"layers {layers.start}-{layers.stop - 1} are all dense (no experts)")
        return cls(digest, cfg, manifest, layers, experts, _lines=lines)

    @classmethod
    def whole(cls, digest: str, manifest: Iterable[str]) -> SliceLayout:
        """Every layer and expert of the model (its shape and sizes, before a part of it is chosen)."""
        manifest = list(manifest)
        cfg = config_from_line(manifest[0]) if manifest else None
        if cfg is None or model_digest(manifest) != digest:
            raise SliceError(f"the manifest does not hash to model {digest[:16]}... (a holder of another model, or forged)")
        return cls.from_manifest(digest, manifest, range(cfg.n_layer), ExpertRange(0, cfg.n_expert))

    def expert_nbytes(self, layer: int) -> int:
        """Bytes of one expert of *layer* (its rows of every stacked tensor), as the manifest's types and shapes say."""
        return sum(int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype)[1:])) for name in expert_tensor_names(self.cfg, self._lines.__contains__, layer) for qtype, shape, _ in [self._lines[name]])

    @property
    def names(self) -> list[str]:
        """The slice's tensors in file order (the order :func:`experts.slices.write_slice` writes them)."""
        return [n for i in filter(self.cfg.is_moe, self.layers) for n in expert_tensor_names(self.cfg, self._lines.__contains__, i)]

    def accept_leaves(self, name: str, leaves: Iterable[str]) -> bool:
        """Keep *leaves* for tensor *name* if they are the manifest's (False: not a slice tensor, or forged)."""
        leaves = list(leaves)
        line = self._lines.get(name)
        if line is None or name not in self.names or hashlib.sha256("".join(leaves).encode()).hexdigest() != line[2]:
            return False
        qtype, shape, _ = line
        if len(leaves) != shape[0]:
            return False
        self.tensors.setdefault(name, SliceTensor(name, qtype, shape, leaves))
        return True

    @property
    def missing_leaves(self) -> list[str]:
        return [n for n in self.names if n not in self.tensors]

    def items(self) -> list[ExpertRows]:
        """Every (tensor, expert) the slice needs; all leaves must be known."""
        if missing := self.missing_leaves:
            raise SliceError(f"no holder gave valid leaves for {missing[0]} (and {len(missing) - 1} more tensors)")
        return [
            ExpertRows(n, int(n.split(".")[1]), e, self.tensors[n].expert_nbytes, self.tensors[n].leaves[e])
            for n in self.names
            for e in range(self.experts.start, self.experts.stop)
        ]

    def write(self, out: Path, staging: Staging) -> Path:
        """Write the slice from the staged experts (each re-read from its verified file)."""
        tensors = []
        for name in self.names:
            t = self.tensors[name]
            rows = np.stack([staging.read(t.leaves[e], t.expert_nbytes) for e in range(self.experts.start, self.experts.stop)])
            tensors.append((t, rows))
        tmp = out.with_name(out.name + ".tmp")
        write_slice_file(tmp, self.cfg, self.manifest, self.layers, self.experts, tensors)
        os.replace(tmp, out)
        return out


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
        fails its hash on resume (:meth:`verified`) and is fetched again."""
        tmp = self.path(item.leaf).with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path(item.leaf))

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
    """A peer that says it serves (layers x experts) of the model, as its SliceInfo says."""

    peer: str
    layers: range
    experts: range
    strikes: int = 0

    def has(self, item: ExpertRows) -> bool:
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
