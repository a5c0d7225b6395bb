"""What the OpenAI gateway serves with, as one typed value (the backbone's own options are
``node.backbone.options.BackboneOptions``)."""

from __future__ import annotations

from dataclasses import dataclass

from node.backbone.batching import DEFAULT_WINDOW_S
from node.gateway.server import BODY_TIMEOUT


@dataclass(frozen=True)
class GatewayOptions:
    """*max_batch* sequences decode at once (their MoE layers share dispatches), *max_queue* more may wait (then 429);
    a layer's batch leaves *window_s* after its last arrival; *prefix_bytes* of cached prompt prefixes (0: none);
    *speculative* greedy requests verify *drafter*'s drafts in one pass; an info summary every *summary_s*; a body
    must arrive within *body_timeout* of its headers (then 408)."""

    max_batch: int = 8
    max_queue: int = 64
    window_s: float = DEFAULT_WINDOW_S
    prefix_bytes: int = 0
    speculative: bool = True
    drafter: str = "ngram"
    summary_s: float = 60.0
    body_timeout: float = BODY_TIMEOUT
