"""experts.rows: each caller of a batched pass gets exactly its own rows back."""

from __future__ import annotations

import numpy as np

from experts.rows import split_rows


def test_split_rows_cuts_at_the_stacking_boundaries():
    """Stacking parts then splitting by their row counts gives each part back, in order, as views."""
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 4)).astype(np.float32) for n in (3, 1, 5)]
    out = np.concatenate(parts)
    blocks = split_rows(out, [p.shape[0] for p in parts])
    assert len(blocks) == 3
    for got, want in zip(blocks, parts, strict=True):
        assert np.array_equal(got, want)
        assert np.shares_memory(got, out)


def test_split_rows_of_nothing_is_nothing():
    """No callers, no blocks; a zero-row caller gets an empty block."""
    out = np.zeros((2, 3), dtype=np.float32)
    assert split_rows(out, []) == []
    assert [b.shape for b in split_rows(out, [0, 2])] == [(0, 3), (2, 3)]
