"""The router of an arch: what llama.cpp hard-codes for it and what it reads from the file (ARCHS.md §2.6).

The math is :func:`experts.moe.route`; this is where each arch's choices come from. An arch either fixes its
gating and renormalisation (qwen, olmoe, gpt-oss, llama4) or reads some of them from the file (:data:`FROM_FILE`:
DeepSeek-V3's router, as deepseek2, glm4moe, dots1, bailingmoe2 and step35 have it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gguf

from ..arch import Gating
from ..errors import ModelFormatError
from .attention import Shapes
from .keys import Keys

if TYPE_CHECKING:
    from ..config import ModelConfig

GATING, NORM, SCALE = "expert_gating_func", "expert_weights_norm", "expert_weights_scale"
FROM_FILE = (GATING, NORM, SCALE)


class Presence(enum.Enum):
    """Whether an arch's layers carry a tensor: never, always (llama.cpp refuses a file without it), or if present."""

    NONE = "none"
    REQUIRED = "required"
    OPTIONAL = "optional"


@dataclass(frozen=True)
class RouterSpec:
    gating: Gating | None = Gating.SOFTMAX  # hard-coded, or the default when the file has no GATING key; None: the file must name it
    norm: bool = False  # renormalise the top-k weights (hard-coded, or the default when NORM is not read)
    reads: tuple[str, ...] = ()  # which of GATING, NORM, SCALE llama.cpp reads from the file for this arch
    selection_bias: Presence = Presence.NONE  # blk.N.exp_probs_b.bias: added to the probabilities for top-k selection only
    logit_bias: bool = False  # blk.N.ffn_gate_inp.bias: added to the router logits (gpt-oss)
    select_on_logits: bool = False  # top-k on the raw router logits, the weights still the gated probabilities (llama4)
    weight_before_expert: bool = False  # y_j = expert_j(w_j x), not w_j expert_j(x) (llama4)

    @property
    def optional_tensors(self) -> tuple[str, ...]:
        return ("exp_probs_b.bias",) if self.selection_bias is Presence.OPTIONAL else ()

    def read(self, k: Keys, n_expert: int) -> dict:
        """The router fields of the config: gating / norm / scale where read, expert groups for every arch."""
        out: dict = {}
        if GATING in self.reads:
            code = k.req(GATING) if self.gating is None else k.opt(GATING, 0)
            try:
                out["gating"] = Gating(int(code)).name.lower() if code else self.gating.name.lower()  # type: ignore[union-attr]
            except ValueError:
                raise ModelFormatError(f"{k.prefix}{GATING} is {code}; supported: " + ", ".join(f"{g.value} ({g.name.lower()})" for g in Gating)) from None
        if NORM in self.reads:
            out["norm_topk"] = bool(k.opt(NORM, False))
        if SCALE in self.reads:
            out["expert_weights_scale"] = float(k.opt(SCALE, 0.0))
        n_groups = int(k.opt("expert_group_count", 0))
        n_group_used = int(k.req("expert_group_used_count")) if n_groups > 1 else 0
        if n_groups > 1 and not (n_expert % n_groups == 0 and 0 < n_group_used < n_groups < n_expert):  # llama.cpp asserts the same
            raise ModelFormatError(f"{k.prefix}expert_group_count {n_groups} / expert_group_used_count {n_group_used} do not fit {n_expert} experts (llama.cpp needs 0 < used < groups < experts, groups dividing the experts)")
        if n_groups > 1:  # 1/1 (as GLM files say) means no grouping
            out |= {"n_expert_groups": n_groups, "n_group_used": n_group_used}
        return out

    def write(self, w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
        """The keys :meth:`read` reads, where the config has them."""
        if cfg.gating is not None:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType[cfg.gating.upper()])
        if cfg.norm_topk is not None:
            w.add_expert_weights_norm(cfg.norm_topk)
        if cfg.expert_weights_scale:
            w.add_expert_weights_scale(cfg.expert_weights_scale)
        if cfg.n_expert_groups:
            w.add_expert_group_count(cfg.n_expert_groups)
            w.add_expert_group_used_count(cfg.n_group_used)

    def shapes(self, cfg: ModelConfig, b: str) -> Shapes:
        """A MoE layer's router biases (the router matrix itself comes first, with the experts)."""
        out: Shapes = {}
        if self.selection_bias is not Presence.NONE:
            out[b + "exp_probs_b.bias"] = (cfg.n_expert,)
        if self.logit_bias:
            out[b + "ffn_gate_inp.bias"] = (cfg.n_expert,)
        return out

    def required_keys(self) -> set[str]:
        return {GATING} if self.gating is None else set()
