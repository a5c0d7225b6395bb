"""MTP drafting: the model's own multi-token-prediction block proposes the draft tokens.

DeepSeek-V3, GLM-4.5 and their kin ship ``nextn_predict_layers`` blocks after the trunk, trained to
predict the token after next. One block is a full decoder layer (its own attention and KV cache, a
MoE FFN) fed with the trunk's last hidden state of a position and the embedding of the token that
follows it, as llama.cpp's ``graph_mtp`` (``src/models/glm4-moe.cpp``, ``deepseek2.cpp``) runs it::

    x  = eh_proj(concat(enorm(embed(t[q])), hnorm(h[q - 1])))   # the token at q, the trunk's state at q - 1
    x  = block(x, position q)                                   # attention over the block's own cache
    g  = shared_head_norm(x) ; logits = head(g)                 # a guess for t[q + 1]

where ``h`` is the trunk's output-normed state (what its logits are computed from) and ``embed``,
``shared_head_norm`` and ``head`` are the block's ``nextn.*`` tensors when the file has them, else the
trunk's. Chaining a draft feeds ``g`` back as the next position's ``h`` (llama.cpp's ``h_nextn``).

Position q's cache row needs t[q] and h[q - 1] (the first position pairs with zeros, as llama.cpp's
drafter starts), so after each verify pass the block catches up over the newly kept tokens with the
trunk rows that pass computed; the last catch-up row already yields the first draft token, and each
further one costs one single-row pass of the block. Its routed experts are computed here, on the
backbone, from the full file: a draft never waits for a round trip. Greedy output does not depend on
any of this (:mod:`experts.speculative` verifies every draft), only the number of passes does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dense_weights import Linear
from .errors import LocalProtocolError, UsageError
from .forward import Backbone, KVCache, MoeFfn, local_moe, rms_norm
from .moe import ungrouped_moe
from .packed_experts import PackedExperts
from .slices import ExpertStore


class NoMtpError(UsageError):
    """MTP drafting was asked of a model whose file has no nextn (MTP) blocks."""


@dataclass(frozen=True)
class NextN:
    """The parts of an MTP block around its decoder layer: the input projection and norms, and its head."""

    eh_proj: Linear  # (n_embd, 2 n_embd): [enorm(embedding), hnorm(hidden)] -> the block's input
    enorm: np.ndarray
    hnorm: np.ndarray
    head_norm: np.ndarray  # nextn.shared_head_norm, else output_norm
    head: Linear  # nextn.shared_head_head, else the trunk's output
    embed: Linear  # nextn.embed_tokens, else token_embd

    @classmethod
    def load(cls, backbone: Backbone, layer: int) -> NextN:
        model, lin, b = backbone.model, backbone._weights, f"blk.{layer}.nextn."
        own = lambda name: model.has(b + name + ".weight")  # noqa: E731
        return cls(
            eh_proj=lin.linear(b + "eh_proj.weight"),
            enorm=model.dense(b + "enorm.weight"),
            hnorm=model.dense(b + "hnorm.weight"),
            head_norm=model.dense(b + "shared_head_norm.weight") if own("shared_head_norm") else backbone.output_norm,
            head=lin.linear(b + "shared_head_head.weight") if own("shared_head_head") else backbone.output,
            embed=lin.linear(b + "embed_tokens.weight") if own("embed_tokens") else backbone.tok_embd,
        )


class MtpDrafter:
    """The first MTP block of *backbone*'s model as a drafter; one :class:`MtpRun` per generation.

    Holds only read-only weights, so concurrent sequences (the gateway's) share it; each run keeps its own
    cache of the block. llama.cpp drafts with the first block too (glm4moe / deepseek2 have one).
    """

    def __init__(self, backbone: Backbone) -> None:
        cfg = backbone.cfg
        if cfg.n_nextn < 1:
            raise NoMtpError(f"{backbone.model.path.name} has no MTP (nextn) blocks; draft with --drafter ngram")
        self.backbone = backbone
        self.layer = cfg.n_layer  # the first block after the trunk
        backbone.load_mtp()
        self.nextn = NextN.load(backbone, self.layer)
        mtp = range(self.layer, self.layer + 1)
        store = PackedExperts(backbone.model, backbone.kernel, mtp) if backbone.kernel else ExpertStore(backbone.model, mtp)
        self.moe: MoeFfn = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))

    def run(self, start: int) -> MtpRun:
        """State for one generation whose first fed position is *start* (a resumed prefix's length, else 0)."""
        return MtpRun(self, start)

    def step(self, tokens: np.ndarray, h: np.ndarray, pos: np.ndarray, cache: KVCache) -> tuple[np.ndarray, np.ndarray]:
        """The block over rows (tokens[r], h[r]) at positions *pos*: (logits (n, vocab), output-normed states (n, d))."""
        nx, eps = self.nextn, self.backbone.cfg.rms_eps
        x = nx.eh_proj(np.concatenate([rms_norm(nx.embed.rows(tokens), nx.enorm, eps), rms_norm(h, nx.hnorm, eps)], axis=1))
        g = rms_norm(self.backbone.block(self.layer, x, pos, cache, self.moe), nx.head_norm, eps)
        return nx.head(g), g


class MtpRun:
    """One generation's MTP state: the block's cache over the kept tokens, and trunk rows not consumed yet.

    Positions count from the run's first fed one: a resumed run has no trunk states for its cached prefix,
    so the block attends to what this run fed (RoPE scores depend on position differences only).
    """

    def __init__(self, drafter: MtpDrafter, start: int) -> None:
        self.drafter, self.start = drafter, start
        n_layer, d = drafter.layer, drafter.backbone.cfg.n_embd
        # The block is layer n_layer: the trunk's slots stay empty so its index addresses its own rows.
        empty = np.zeros((0, 0), dtype=np.float32)
        self.cache = KVCache([empty] * n_layer, [empty] * n_layer)
        self.done = 0  # positions (from start) whose block row is cached
        self.hidden = np.zeros((1, d), dtype=np.float32)  # trunk states of positions done - 1 ... (zeros before the first)

    def observe(self, hidden: np.ndarray) -> None:
        """The trunk's output-normed states of the next kept positions (rows of a pass, rejected drafts left out)."""
        self.hidden = np.concatenate([self.hidden, hidden])

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Catch the block up to every token of *context* with the observed states, then chain k greedy guesses."""
        if k <= 0:
            return []
        cache, step = self.cache, self.drafter.step
        n = len(context) - self.start  # tokens this run has; the block needs a state before each
        fresh = np.arange(self.done, n)
        if fresh.size != self.hidden.shape[0] or fresh.size == 0:
            raise LocalProtocolError(f"MTP catch-up over positions {self.done}..{n - 1} has {self.hidden.shape[0]} trunk states; observe each pass's kept rows")
        logits, g = step(np.asarray(context[self.start + fresh]), self.hidden[: fresh.size], fresh, cache)
        self.hidden, self.done = self.hidden[fresh.size :], n
        draft = [int(np.argmax(logits[-1]))]
        for q in range(n, n + k - 1):
            logits, g = step(np.array(draft[-1:]), g[-1:], np.array([q]), cache)
            draft.append(int(np.argmax(logits[-1])))
        cache.truncate(n)  # the chained rows stand on guesses, not trunk states
        return draft
