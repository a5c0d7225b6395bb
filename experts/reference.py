"""llama.cpp as the reference engine (optional extra ``llama``: llama-cpp-python)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import UsageError


def llamacpp(path: str | Path, *, n_ctx: int, n_batch: int, threads: int = 1, threads_batch: int | None = None, logits_all: bool = False):
    """A llama-cpp-python ``Llama`` on *path* with an F32 KV cache (what our forward keeps), quiet.

    *threads* decode single tokens, *threads_batch* prompts (llama-cpp-python's default: every core).
    """
    try:
        import llama_cpp
    except ImportError:
        raise UsageError("the llama.cpp reference needs llama-cpp-python: pip install -e '.[llama]'") from None
    return llama_cpp.Llama(
        model_path=str(path),
        logits_all=logits_all,
        n_ctx=n_ctx,
        n_batch=n_batch,
        type_k=0,
        type_v=0,
        n_threads=threads,
        n_threads_batch=threads_batch,
        verbose=False,
    )


# A child that prints llama.cpp's logits of argv[1] for the tokens argv[2:] as raw float32 (shape: n x vocab).
_CHILD = "import sys; from experts.reference import llamacpp_logits; sys.stdout.buffer.write(llamacpp_logits(sys.argv[1], [int(t) for t in sys.argv[2:]]).tobytes())"


def llamacpp_logits(path: str | Path, tokens: list[int], *, isolated: bool = False) -> np.ndarray:
    """llama.cpp's logits for every position of *tokens*, F32 KV cache, one thread (steady numerics).

    *isolated* runs llama.cpp in a child process. Why: ggml-python's older libggml (the ggml kernel's) and
    llama.cpp's share library names, so once one is loaded the other's graphs run on it; ops only the newer one has
    (deepseek32's lightning indexer, top-k and fill) then abort the whole process.
    """
    if isolated:
        import subprocess
        import sys

        out = subprocess.run([sys.executable, "-c", _CHILD, str(path), *map(str, tokens)], capture_output=True, check=False, timeout=600)
        if out.returncode:
            raise RuntimeError(f"llama.cpp on {path} failed ({out.returncode}): {out.stderr.decode(errors='replace')[-2000:]}")
        return np.frombuffer(out.stdout, dtype=np.float32).reshape(len(tokens), -1).copy()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    llm = llamacpp(path, n_ctx=max(64, len(tokens)), n_batch=max(64, len(tokens)), logits_all=True)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()
