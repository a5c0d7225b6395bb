"""The local engine tests compare a swarm against: the kernel worker processes use by default (ggml).

Workers started through the CLI self-test and use ``ggml`` with every core; the local run here uses
one thread. Its bits must equal theirs (a ggml output element is one dot product whichever thread
computes it), so every swarm test also checks that the thread count changes no bits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from experts.forward import Backbone
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.hosting import open_experts
from experts.kernels import Kernel, make_kernel
from experts.moe import ExpertSource


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
