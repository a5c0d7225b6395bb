"""What every benchmark shares: the reference config, exact message sizes, a median timer, its error."""

from __future__ import annotations

import time

import numpy as np

from experts.codecs import Codec, encoded_size
from experts.errors import UsageError

REFERENCE = dict(arch="qwen3moe", n_layer=1, n_embd=3072, n_head=24, n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768)


class BenchmarkError(UsageError):
    """A benchmark could not measure what it was asked to (its message says which option to change)."""


def median_time(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls of `fn`, after one warm-up call."""
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def message_bytes(d: int, k: int, n_tokens: int = 1) -> dict:
    """Exact dispatch message sizes per token per layer, for one worker holding all k experts of a token.

    ``partial_*``: what the protocol sends (one weighted sum per token back). ``raw_*``: the
    baseline of returning every expert's output (k vectors per token), sized with the same framing.
    """
    from p2p import wire

    out = {}
    ids = tuple(range(k)) * n_tokens
    weights = (1.0 / k,) * (k * n_tokens)
    for codec in Codec:
        hidden = b"\0" * encoded_size(codec, n_tokens, d)
        req = wire.DispatchRequest(b"\1" * 16, b"\2" * 16, 0, codec, n_tokens, k, ids, weights, hidden).encode()
        for kind, rows in (("partial", n_tokens), ("raw", n_tokens * k)):
            reply = wire.DispatchReply(b"\1" * 16, codec, n_tokens, b"\0" * encoded_size(codec, rows, d), 0, b"\0" * 72).encode()
            out[f"{kind}_{codec.name.lower()}"] = {"out": len(req) / n_tokens, "back": len(reply) / n_tokens, "total": (len(req) + len(reply)) / n_tokens}
    return out
