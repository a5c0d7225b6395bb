"""A GGUF file's metadata as an arch reads it: keys under ``<arch>.``, with one-line errors when llama.cpp needs them."""

from __future__ import annotations

from typing import Any

import gguf

from ..errors import ModelFormatError


def field(reader: gguf.GGUFReader, key: str, *, required: bool = True, default: Any = None) -> Any:
    """The value of the full key *key*; a missing required key is named in one line."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelFormatError(f"GGUF key {key!r} is missing; the file was not written by a llama.cpp-compatible converter")
        return default
    return f.contents()


def one_value(value: Any, key: str) -> int:
    """A key llama.cpp reads with get_key_or_arr into one value per layer, where moeswarm supports one value for all."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelFormatError(f"{key} differs between layers ({value}); moeswarm supports one value for every layer")
        value = value[0]
    return int(value)


class Keys:
    """The ``<arch>.*`` keys of one file: :meth:`req` (llama.cpp refuses the file without it), :meth:`opt`, :meth:`one`."""

    def __init__(self, reader: gguf.GGUFReader, arch: str) -> None:
        self.reader = reader
        self.arch = arch
        self.prefix = arch + "."

    def req(self, key: str) -> Any:
        return field(self.reader, self.prefix + key)

    def opt(self, key: str, default: Any) -> Any:
        return field(self.reader, self.prefix + key, required=False, default=default)

    def one(self, key: str) -> int:
        """A required per-layer key that must hold one value for every layer."""
        return one_value(self.req(key), self.prefix + key)

    def general(self, key: str, default: Any = None) -> Any:
        """A key outside the arch's prefix (``general.name``, ``tokenizer.ggml.tokens``), optional."""
        return field(self.reader, key, required=False, default=default)
