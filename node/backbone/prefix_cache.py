"""Prefix cache: keys/values of recent sequences, reused when a new prompt starts the same way.

A chat client resends the whole history with one more message; without a cache the
backbone recomputes (and re-dispatches) every earlier token. Here the KV of each
finished sequence is kept under its tokens; a new prompt starts from the longest
common prefix with a cached sequence of the same namespace (a session id, so one
user's prompts are never timed against another's), and only the rest is prefilled
(the looked-up cache is the ``cache`` that :func:`experts.generate.generate` and
:func:`experts.speculative.speculative_generate` start from).

Exactness: the forward is batch invariant (:mod:`experts.forward`), so a position's
keys and values are the same bits whether they were computed in a long prefill, one
token at a time, or in a speculative verify pass, and resuming from them gives the
logits a full prefill gives.

A cheater caught after its sums went into an entry's keys/values must not reach a later
prompt through the cache: each entry keeps its taint (the first position that used each
host's unchecked sums, :meth:`node.backbone.provenance.Provenance.taint`), a lookup uses an
entry only up to the first position of a host caught since, and hands on the taint of what
it reuses so that a catch during the new sequence cuts back into the reused part too.

Memory is bounded (bytes of KV held); the least recently used entries go first. The
cache is shared by sequence threads (one lock; copies are made outside it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from experts.forward import KVCache


@dataclass
class _Entry:
    namespace: str | None
    tokens: np.ndarray  # int64, one per cached position
    cache: KVCache
    nbytes: int
    taint: dict[str, int]  # host -> first cached position that used its unchecked sums


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one position
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0

    def summary(self, entries: int, nbytes: int) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "reused_tokens": self.reused_tokens, "stored": self.stored, "evicted": self.evicted, "entries": entries, "bytes": nbytes}


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """LRU of (namespace, tokens) -> KVCache, at most *max_bytes* of keys and values."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._bytes = 0
        self._lock = threading.Lock()

    def lookup(self, namespace: str | None, prompt: Sequence[int], culprits: Collection[str] = ()) -> tuple[KVCache, dict[str, int]]:
        """A cache holding the longest cached prefix of *prompt* (never all of it: one token is left to feed), and the
        taint of its positions; no position at or after one that used a *culprits* host's sums is reused.

        The result shares arrays with the entry; that is safe because the forward never
        writes into a cache's arrays, it replaces them (concatenate, slice).
        """
        tokens = np.asarray(prompt, dtype=np.int64)
        caught = set(culprits)
        with self._lock:
            self.stats.lookups += 1
            best, best_n = None, 0
            for key, e in self._entries.items():
                clean = min((pos for p, pos in e.taint.items() if p in caught), default=len(e.tokens))
                if e.namespace == namespace and (n := min(_common_prefix(e.tokens, tokens), len(tokens) - 1, clean)) > best_n:
                    best, best_n = key, n
            if best is None:
                return KVCache(), {}
            entry = self._entries[best]
            self._entries.move_to_end(best)
            self.stats.hits += 1
            self.stats.reused_tokens += best_n
            taint = {p: pos for p, pos in entry.taint.items() if pos < best_n}
            return entry.cache.prefix(best_n), taint

    def store(self, namespace: str | None, tokens: Sequence[int], cache: KVCache, taint: Mapping[str, int] | None = None) -> None:
        """Keep *cache*'s positions (the first ``cache.n_past`` of *tokens*, prompt then generated) for later prompts,
        with their *taint* (host -> first position that used its unchecked sums)."""
        n = min(cache.n_past, len(tokens))
        if n == 0:
            return
        key_tokens = np.asarray(tokens[:n], dtype=np.int64)
        compact = cache.prefix(n, copy=True)
        nbytes = compact.nbytes
        kept = {p: pos for p, pos in (taint or {}).items() if pos < n}
        if nbytes > self.max_bytes:
            return
        with self._lock:
            for key, e in list(self._entries.items()):
                if e.namespace != namespace:
                    continue
                common = _common_prefix(e.tokens, key_tokens)
                if common == len(key_tokens):  # already covered by an entry at least as long
                    self._entries.move_to_end(key)
                    for p, pos in kept.items():  # the same positions, computed twice: either answer may be caught
                        e.taint[p] = min(pos, e.taint.get(p, pos))
                    return
                if common == len(e.tokens):  # the new one covers this one
                    self._drop(key)
            self._entries[self._next] = _Entry(namespace, key_tokens, compact, nbytes, kept)
            self._next += 1
            self._bytes += nbytes
            self.stats.stored += 1
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes

    def summary(self) -> dict:
        with self._lock:
            return self.stats.summary(len(self._entries), self._bytes)
