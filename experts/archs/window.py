"""Sliding-window attention as each arch declares it: which layers slide, how far, and what the file must say.

The config keeps the result (``n_swa``, ``swa_period`` or a per-layer ``swa_pattern``, ``rope_theta_swa``); which
positions a query sees is :meth:`Window.first_key`, which :meth:`experts.config.ModelConfig.first_key` asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gguf

from ..errors import ModelFormatError
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig

WINDOW, PATTERN = "attention.sliding_window", "attention.sliding_window_pattern"


@dataclass(frozen=True)
class Window:
    """No sliding window: every layer attends to all past positions."""

    rope_base: float = 0.0  # SWA layers' RoPE base when the file has no rope.freq_base_swa; 0: rope.freq_base

    def read(self, k: Keys, n_all: int) -> dict:
        """n_swa / swa_period / swa_pattern of the config."""
        return {}

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if cfg.n_swa:
            w.add_sliding_window(cfg.n_swa)
            w.add_sliding_window_pattern(list(cfg.swa_pattern) or cfg.swa_period)

    def first_key(self, cfg: ModelConfig, pos: int) -> int:
        """The first position query *pos* of an SWA layer attends to (llama.cpp's STANDARD ``is_masked_swa``)."""
        return max(0, pos + 1 - cfg.n_swa)

    def random(self, n_swa: int) -> dict:
        """A random model's window fields, *n_swa* the window it asks for (0: the arch's default)."""
        return {"n_swa": n_swa} if n_swa else {}

    def required_keys(self) -> set[str]:
        return set()


NO_WINDOW = Window()


def _period(k: Keys, default: int) -> int:
    period = k.opt(PATTERN, default)
    if not isinstance(period, int):  # llama.cpp's get_key_or_arr into one period: a per-layer array is another arch's
        raise ModelFormatError(f"{k.prefix}{PATTERN} must be one period for {k.arch}, not a per-layer array")
    return period


@dataclass(frozen=True)
class PeriodicWindow(Window):
    """attention.sliding_window (required) on the layers of llama.cpp's ``set_swa_pattern(period)``: layer i
    slides iff i % period < period - 1; the period from the file if it says (gpt-oss: 2)."""

    period: int = 2

    def read(self, k: Keys, n_all: int) -> dict:
        return {"n_swa": int(k.req(WINDOW)), "swa_period": _period(k, self.period)}

    def random(self, n_swa: int) -> dict:
        return {"n_swa": n_swa, "swa_period": self.period}

    def required_keys(self) -> set[str]:
        return {WINDOW}


@dataclass(frozen=True)
class LayerWindow(Window):
    """attention.sliding_window and one SWA flag per block in sliding_window_pattern, both required (step35;
    llama.cpp's get_arr: any other type is refused)."""

    def read(self, k: Keys, n_all: int) -> dict:
        n_swa = int(k.req(WINDOW))
        pattern = k.req(PATTERN)
        if not isinstance(pattern, list) or len(pattern) != n_all:
            raise ModelFormatError(f"{k.prefix}{PATTERN} must be an array of {n_all} per-layer flags for {k.arch}")
        return {"n_swa": n_swa, "swa_pattern": tuple(bool(x) for x in pattern)}

    def required_keys(self) -> set[str]:
        return {WINDOW, PATTERN}


@dataclass(frozen=True)
class ChunkedWindow(Window):
    """Attention within fixed chunks of *chunk* positions on the layers of ``set_swa_pattern(period)`` (llama4:
    llama.cpp hard-codes chunks of 8192 on 3 of 4 layers; the file may only change the period)."""

    chunk: int = 8192
    period: int = 4

    def read(self, k: Keys, n_all: int) -> dict:
        if k.opt(WINDOW, None) == 0:  # llama.cpp then runs no chunks but still asks for the temperature, and aborts
            raise ModelFormatError(f"{k.prefix}{WINDOW} is 0 (no chunked attention): llama.cpp cannot run such {k.arch} files, so neither do we")
        return {"n_swa": self.chunk, "swa_period": _period(k, self.period)}

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        if cfg.n_swa and cfg.swa_period != self.period:  # the chunk size is fixed by llama.cpp: only another pattern is written
            w.add_sliding_window_pattern(cfg.swa_period)

    def first_key(self, cfg: ModelConfig, pos: int) -> int:
        return pos // cfg.n_swa * cfg.n_swa

    def random(self, n_swa: int) -> dict:
        return {"n_swa": self.chunk, "swa_period": self.period}
