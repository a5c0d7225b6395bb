"""The local engine tests compare a swarm against: the kernel worker processes use by default (ggml).

Workers started through the CLI self-test and use ``ggml`` with every core; the local run here uses
one thread. Its bits must equal theirs (a ggml output element is one dot product whichever thread
computes it), so every swarm test also checks that the thread count changes no bits.
"""

from __future__ import annotations

from experts.forward import Backbone
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
