"""The local engine tests compare a swarm against: the kernel worker processes use by default (ggml).

Workers started through the CLI self-test and use ``ggml`` with every core; the local run here uses
one thread. Its bits must equal theirs (a ggml output element is one dot product whichever thread
computes it), so every swarm test also checks that the thread count changes no bits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from experts.forward import Backbone, local_moe
from experts.generate import Sampling, generate
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import Kernel, make_kernel
from experts.moe import ExpertSource, Partition, grouped_moe
from experts.tokenizer import Tokenizer


def kernel() -> Kernel:
    return make_kernel("ggml", 1)


def local_engine(model: GGUFModel) -> tuple[Backbone, ExpertSource]:
    """The dense part and every expert of *model*, computed by ``kernel()``."""
    k = kernel()
    return Backbone(model, k), open_experts(model, k)[0]


async def generate_off_loop(backbone: Backbone, moe_hook, ids: list[int], n: int, after: Callable[[int], None] = lambda i: None) -> list[int]:
    """Greedy-generate *n* tokens through *moe_hook* on a thread (the hook needs the running loop free), calling
    ``after(i)`` once token *i* is out: swarm tests break things mid-generation there."""

    def go() -> list[int]:
        out = []
        for i, (t, _) in enumerate(generate(backbone, ids, n, moe_hook)):
            out.append(t)
            after(i)
        return out

    return await asyncio.to_thread(go)


def local_completion(engine: tuple[Backbone, ExpertSource], tok: Tokenizer, part: Partition, prompt: str, n: int, sampling: Sampling = Sampling(), stops: tuple[str, ...] = ()) -> tuple[str, int]:
    """The text (and token count) single-process ``generate`` gives with the workers' grouping *part*, cut as the
    gateway cuts it (at end of sequence or before the first stop string)."""
    bb, store = engine

    def moe(i, x, e, w):
        return grouped_moe(store, part, i, x, e, w)

    out: list[int] = []
    text = ""
    for t, _ in generate(bb, tok.encode(prompt), n, local_moe(moe), sampling=sampling, stop={tok.eos_id}):
        out.append(t)
        text = tok.decode([t for t in out if t != tok.eos_id])
        if any(s in text for s in stops):
            return text[: min(text.find(s) for s in stops if s in text)], len(out)
    return text, len(out)
