"""Some layers of a model, indexed by their number in the model: what a stage loads (issue 26).

A stage runs layers A..B with the very methods of a full :class:`experts.forward.Backbone`, which index
``self.layers[i]`` by model layer (the config, the KV cache and the MoE hook all speak model indices). A
``LayerSpan`` keeps that indexing without placeholder layers: asking for a layer the stage does not hold is an
IndexError naming the span, never a silently wrong layer.
"""

from __future__ import annotations

from typing import SupportsIndex, TypeVar, overload

T = TypeVar("T")


class LayerSpan(list[T]):
    """Items for layers ``first .. first + len - 1``, item ``i`` being layer ``i`` of the model."""

    def __init__(self, first: int, items: list[T]) -> None:
        super().__init__(items)
        self.first = first

    @property
    def span(self) -> range:
        return range(self.first, self.first + len(self))

    @overload
    def __getitem__(self, i: SupportsIndex) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: SupportsIndex | slice) -> T | list[T]:
        if isinstance(i, slice):
            raise TypeError("a LayerSpan is indexed by model layer, not sliced")
        if int(i) not in self.span:
            raise IndexError(f"layer {int(i)} is not loaded here (layers {self.first}-{self.first + len(self) - 1})")
        return super().__getitem__(int(i) - self.first)
