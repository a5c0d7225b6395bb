"""llama.cpp as the reference engine (optional extra ``llama``: llama-cpp-python)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import UsageError


def llamacpp(path: str | Path, *, n_ctx: int, n_batch: int, threads: int = 1, threads_batch: int | None = None, logits_all: bool = False, flash_attn: bool | None = None):
    """A llama-cpp-python ``Llama`` on *path* with an F32 KV cache (what our forward keeps), quiet.

    *threads* decode single tokens, *threads_batch* prompts (llama-cpp-python's default: every core). *flash_attn*
    None: on where the file's arch needs it (minimax-m3's sparse attention; without it llama.cpp runs dense attention).
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
        flash_attn=needs_flash_attn(path) if flash_attn is None else flash_attn,
        verbose=False,
    )


def needs_flash_attn(path: str | Path) -> bool:
    """Whether llama.cpp computes the attention of *path*'s arch only with flash attention on."""
    from .gguf_model import GGUFModel

    return GGUFModel(path).cfg.spec.attention.needs_flash_attn


# A child that prints llama.cpp's logits of argv[1] for the tokens argv[4:] as raw float32 (shape: n x vocab), with
# argv[2] tokens per batch (0: all) and flash attention argv[3] (auto, on, off).
_CHILD = (
    "import sys; from experts.reference import llamacpp_logits; fa = {'auto': None, 'on': True, 'off': False}[sys.argv[3]]; "
    "sys.stdout.buffer.write(llamacpp_logits(sys.argv[1], [int(t) for t in sys.argv[4:]], batch=int(sys.argv[2]) or None, flash_attn=fa).tobytes())"
)


def llamacpp_logits(path: str | Path, tokens: list[int], *, isolated: bool = False, batch: int | None = None, flash_attn: bool | None = None) -> np.ndarray:
    """llama.cpp's logits for every position of *tokens*, F32 KV cache, one thread (steady numerics).

    *isolated* runs llama.cpp in a child process. Why: ggml-python's older libggml (the ggml kernel's) and
    llama.cpp's share library names, so once one is loaded the other's graphs run on it; ops only the newer one has
    (deepseek32's lightning indexer, top-k and fill) then abort the whole process. *batch* tokens per llama.cpp
    batch (None: all in one; 1: every token through its one-token decode graph); *flash_attn* as :func:`llamacpp`.
    """
    if isolated:
        import subprocess
        import sys

        fa = {None: "auto", True: "on", False: "off"}[flash_attn]
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(batch or 0), fa, *map(str, tokens)], capture_output=True, check=False, timeout=600)
        if out.returncode:
            raise RuntimeError(f"llama.cpp on {path} failed ({out.returncode}): {out.stderr.decode(errors='replace')[-2000:]}")
        return np.frombuffer(out.stdout, dtype=np.float32).reshape(len(tokens), -1).copy()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    n_batch = batch or max(64, len(tokens))
    llm = llamacpp(path, n_ctx=max(64, len(tokens)), n_batch=n_batch, logits_all=True, flash_attn=flash_attn)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()
