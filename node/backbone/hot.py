"""Hot experts local (EPLB-style): the backbone keeps its most-used experts and computes them itself.

Routing is skewed: a few experts per layer take a large share of tokens. Computing those
at the backbone, concurrently with the round trip for the rest, takes them off the
network and off the workers' queues. Load is an exponential moving average of how often
each expert is selected; every ``refresh_every`` dispatches of a layer the local set
becomes that layer's top experts within the budget. Decisions depend only on the
routing history, so a replay of the same tokens makes the same choices (tests rely on it).
Sans-IO: the backbone feeds it routing decisions and asks which experts are local.
"""

from __future__ import annotations

import numpy as np

from experts.errors import UsageError


class HotExperts:
    def __init__(self, n_layer: int, n_expert: int, budget: int, *, alpha: float = 0.1, refresh_every: int = 4) -> None:
        if not 0 <= budget <= n_expert:
            raise UsageError(f"local expert budget {budget} must be between 0 and {n_expert} (experts per layer)")
        self.budget = budget
        self.alpha = alpha
        self.refresh_every = refresh_every
        self.load = np.zeros((n_layer, n_expert), dtype=np.float64)
        self._hot = np.zeros((n_layer, n_expert), dtype=bool)
        self._seen = np.zeros(n_layer, dtype=np.int64)
        self.selections = 0
        self.local_selections = 0

    @classmethod
    def for_memory(cls, n_layer: int, n_expert: int, n_embd: int, n_ff_exp: int, memory: int, **kw) -> HotExperts:
        """As many experts per layer as fit *memory* bytes of float32 weights across all layers."""
        per_expert = 3 * n_embd * n_ff_exp * 4
        return cls(n_layer, n_expert, min(n_expert, memory // (per_expert * n_layer)), **kw)

    def hot(self, layer: int) -> np.ndarray:
        """Boolean mask (n_expert,) of the experts computed locally for *layer* right now."""
        return self._hot[layer]

    def observe(self, layer: int, expert_ids: np.ndarray) -> None:
        """Account one dispatch's routing (after it used the current local set)."""
        counts = np.bincount(expert_ids.ravel(), minlength=self.load.shape[1])
        self.selections += int(expert_ids.size)
        self.local_selections += int(self._hot[layer][expert_ids].sum())
        self.load[layer] = (1 - self.alpha) * self.load[layer] + self.alpha * counts
        self._seen[layer] += 1
        if self.budget and self._seen[layer] % self.refresh_every == 0:
            top = np.argsort(-self.load[layer], kind="stable")[: self.budget]
            self._hot[layer] = False
            self._hot[layer][top[self.load[layer][top] > 0]] = True

    @property
    def hit_rate(self) -> float:
        """Share of (token, expert) selections served by the backbone's local experts."""
        return self.local_selections / self.selections if self.selections else 0.0
