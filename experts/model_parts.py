"""A model's dense weights and head opened from dense and head slice files, read like the full file.

A stage runs the dense part of some layers and a client the embeddings and output head (issue 26): neither holds
the full GGUF. :class:`SlicedModel` verifies each slice against the model digest (:func:`experts.slices.check_slice`:
every tensor's bytes against the manifest, the head's tokenizer keys too), then answers the reads the forward makes
(``has``, ``raw``, ``dense``, ``qtype``, ``shape``, ``cfg``, ``tokenizer_spec``) from whichever slice holds the
tensor, zero copy from its memory map. So ``Backbone(SlicedModel([head, dense 0-N]))`` is the full model's backbone
bit for bit, its routed experts coming from expert slices or workers; a stage's slices cover only its layers
(:attr:`SlicedModel.layers`) and a client's only the head (:attr:`has_head`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from .errors import SliceError
from .gguf_model import ExpertRange, GGUFModel
from .moe import Progress
from .parts import Part
from .slices import check_slice


class SlicedModel(GGUFModel):
    """The union of verified dense and head slices of one model (no routed experts: those are served apart)."""

    def __init__(self, parts: Sequence[GGUFModel], expected_digest: str | None = None, progress: Progress | None = None) -> None:
        if not parts:
            raise SliceError("give at least one dense or head slice")
        digest = expected_digest or parts[0].digest
        dense: set[int] = set()
        self.tensors = {}
        self._owner: dict[str, GGUFModel] = {}
        heads = []
        for done, part in enumerate(parts, 1):
            if part.kind not in (Part.DENSE, Part.HEAD):
                raise SliceError(f"{part.path} is {'the full model' if part.kind is None else 'an expert slice'}; give dense (--dense) or head (--head) slices")
            check_slice(part, digest)  # every tensor against the manifest, which hashes to the digest
            if part.kind is Part.HEAD:
                heads.append(part)
            else:
                dense |= set(part.layers)
            for name, t in part.tensors.items():
                self.tensors[name] = t
                self._owner[name] = part
            if progress:
                progress(done, len(parts))
        if dense and sorted(dense) != list(range(min(dense), max(dense) + 1)):
            raise SliceError(f"the dense slices cover layers {sorted(dense)}: not one contiguous range")
        first = parts[0]
        self.path, self.cfg, self.slice = first.path, first.cfg, None
        self.parts = list(parts)
        self.reader = (heads or [first])[0].reader  # the tokenizer keys live in the head slice
        self.dense_layers = range(min(dense), max(dense) + 1) if dense else range(0)
        self.has_head = bool(heads)
        self._digest = digest

    @cached_property
    def digest(self) -> str:
        return self._digest

    @property
    def layers(self) -> range:
        """The layers whose dense weights these slices hold."""
        return self.dense_layers

    @property
    def mtp_layers(self) -> range:
        return range(0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def experts(self) -> ExpertRange:
        raise SliceError("dense and head slices hold no routed experts: open expert slices (or workers) for them")

    @property
    def manifest(self) -> list[str]:
        """The model's manifest as the (verified) slices carry it."""
        assert self.parts[0].slice is not None
        return self.parts[0].slice.manifest

    @property
    def leaves(self) -> dict[str, list[str]]:
        return {}  # no stacked expert tensor

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes from the slice that holds it (zero copy); KeyError if none does."""
        return self._owner[name].raw(name)
