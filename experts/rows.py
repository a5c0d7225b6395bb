"""Handing each caller its own rows back from one batched result.

The backbone's batcher (several sequences, one dispatch) and the worker's service (several dispatches, one expert
pass) both stack their callers' rows in arrival order with ``np.concatenate`` and cut the result at the same
boundaries; ``split_rows`` is that cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def split_rows(out: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """``out`` cut into consecutive blocks of ``counts[i]`` rows, in order (views, no copy)."""
    blocks, start = [], 0
    for n in counts:
        blocks.append(out[start : start + n])
        start += n
    return blocks
