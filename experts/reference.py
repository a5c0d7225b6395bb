"""llama.cpp as the reference engine (optional extra ``llama``: llama-cpp-python)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import UsageError


def llamacpp_logits(path: str | Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position of *tokens*, F32 KV cache, one thread (steady numerics)."""
    try:
        import llama_cpp
    except ImportError:
        raise UsageError("the llama.cpp reference needs llama-cpp-python: pip install -e '.[llama]'") from None
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    llm = llama_cpp.Llama(
        model_path=str(path),
        logits_all=True,
        n_ctx=max(64, len(tokens)),
        n_batch=max(64, len(tokens)),
        type_k=0,
        type_v=0,
        n_threads=1,
        verbose=False,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()
