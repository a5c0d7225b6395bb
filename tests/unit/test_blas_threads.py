"""The test process runs numpy's BLAS on one thread: the root conftest fixes it before numpy loads (OpenBLAS reads the
setting once, at load time, so a later hook would be too late and the numerics tests would spin two threads)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest


def openblas_threads() -> int | None:
    """The thread count the OpenBLAS numpy loaded reports, or None when numpy uses another BLAS."""
    np.ones((2, 2)) @ np.ones((2, 2))  # make sure the BLAS is loaded and initialised
    libs = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "openblas" in line.lower() and line.split()[-1].startswith("/")})
    for path in libs:
        lib = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(lib, symbol):
                return int(getattr(lib, symbol)())
    return None


def test_numpy_blas_runs_one_thread_in_the_test_process():
    """OpenBLAS in this process was started with OPENBLAS_NUM_THREADS=1, not one thread per core."""
    threads = openblas_threads()
    if threads is None:
        pytest.skip("numpy is not linked against OpenBLAS here")
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    assert threads == 1
