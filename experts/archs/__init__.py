"""One module per model family, each an :class:`Arch` (or a subclass with its quirks) over shared mechanism parts:
attention (:mod:`.attention`, :mod:`.mla`, :mod:`.dsa`, :mod:`.msa`, :mod:`.gdn`, :mod:`.kda`), sliding windows (:mod:`.window`), routers (:mod:`.router`),
experts, shared experts and layer schedules (:mod:`.ffn`).

Adding an architecture means one family module (or one more Arch in an existing one) and its line in :data:`ARCHS`.
"""

from __future__ import annotations

from ..errors import ModelFormatError
from .bailing import BAILINGMOE2
from .base import Arch
from .deepseek import DEEPSEEK2, DEEPSEEK32
from .dots import DOTS1
from .ernie import ERNIE4_5_MOE
from .glm import GLM4MOE
from .gpt_oss import GPT_OSS
from .kimi import KIMI_LINEAR
from .llama import LLAMA, LLAMA4
from .minimax import MINIMAX_M2, MINIMAX_M3
from .olmoe import OLMOE
from .qwen import QWEN2MOE, QWEN3MOE, QWEN3VLMOE
from .qwen_next import QWEN3NEXT, QWEN35MOE
from .step import STEP35

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        QWEN2MOE, QWEN3MOE, LLAMA, OLMOE, GLM4MOE, MINIMAX_M2, GPT_OSS, QWEN3VLMOE, DOTS1, ERNIE4_5_MOE, BAILINGMOE2,
        DEEPSEEK2, LLAMA4, QWEN3NEXT, QWEN35MOE, STEP35,
        KIMI_LINEAR, DEEPSEEK32,
        MINIMAX_M3,
    )
}


def arch_spec(name: str) -> Arch:
    """Look up an architecture; the error lists what is supported."""
    try:
        return ARCHS[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHS))
        raise ModelFormatError(f"unsupported architecture {name!r} (general.architecture); supported: {supported}") from None


__all__ = ["ARCHS", "Arch", "arch_spec"]
