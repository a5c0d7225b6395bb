"""Which stages a client chains: the cover of every layer with the least estimated latency (sans-IO, issue 26).

Theory of operation. A pass goes through the chain's stages one after the other, so its latency is the sum over
hops of the round trip to that stage plus the stage's compute. Every chain that covers the model runs each layer
exactly once, so the compute is (to first order) the same whichever stages run it and the choice is about the
hops: each costs its measured round trip plus ``hop_ms``, a fixed per-hop cost (framing, the stage's pass set-up,
the rows crossing the wire once more) that makes one hop of 5 ms beat two of 2 ms each when it is large enough.

A stage runs exactly the layers it announced (``StagePass.layers`` must equal them), so a chain is a path from layer
0 to ``n_layer`` through stages whose ranges meet end to start: overlapping stages that do not meet are never chained,
and a gap (a layer no stage reaches from layer 0) means there is no chain: :class:`NoChain` says where it breaks.
The layers are the nodes of a DAG, stages its edges, so one pass over the layer boundaries in order finds the best
path. Ties are broken by fewer hops, then the lower total price, then peer ids, so every client that measured the
same RTTs picks the same chain (deterministic, testable).

No clock and no sockets here: the client (``node.stage.client``) measures the RTTs and hands them in.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from experts.errors import MoeSwarmError

HOP_MS = 1.0  # per-hop cost on top of its round trip (see the module docstring)


class NoChain(MoeSwarmError):
    """No chain of the measured stages covers every layer of the model; the message says which layer breaks it."""


@dataclass(frozen=True)
class Candidate:
    """A stage the client may use: its peer (text id), the layers it runs, its measured round trip and price."""

    peer: str
    layers: range
    rtt_ms: float
    price: int = 0

    @property
    def span(self) -> str:
        return f"{self.layers.start}-{self.layers.stop - 1}"


@dataclass(frozen=True, order=True)
class _Cost:
    latency_ms: float
    hops: int
    price: int
    peers: tuple[str, ...]


def estimated_ms(chain: Sequence[Candidate], hop_ms: float = HOP_MS) -> float:
    """The latency a pass through *chain* is estimated to add: its round trips and per-hop costs."""
    return sum(c.rtt_ms + hop_ms for c in chain)


def choose_chain(candidates: Collection[Candidate], n_layer: int, hop_ms: float = HOP_MS) -> list[Candidate]:
    """The chain of *candidates* over layers 0..n_layer-1 with the least estimated latency, or :class:`NoChain`."""
    usable = [c for c in candidates if c.layers and c.layers.step == 1 and 0 <= c.layers.start < c.layers.stop <= n_layer]
    starting: dict[int, list[Candidate]] = {}
    for c in usable:
        starting.setdefault(c.layers.start, []).append(c)
    best: dict[int, tuple[_Cost, tuple[Candidate, ...]]] = {0: (_Cost(0.0, 0, 0, ()), ())}
    for at in sorted(starting):
        if at not in best:
            continue  # no chain reaches this boundary: the stages starting here are unusable
        cost, path = best[at]
        for c in starting[at]:
            step = _Cost(cost.latency_ms + c.rtt_ms + hop_ms, cost.hops + 1, cost.price + c.price, (*cost.peers, c.peer))
            held = best.get(c.layers.stop)
            if held is None or step < held[0]:
                best[c.layers.stop] = (step, (*path, c))
    if n_layer in best and n_layer > 0:
        return list(best[n_layer][1])
    raise NoChain(_why(usable, best, n_layer))


def _why(usable: Sequence[Candidate], best: dict, n_layer: int) -> str:
    reach = max(best)
    spans = ", ".join(sorted({c.span for c in usable}, key=lambda s: tuple(int(v) for v in s.split("-")))) or "none"
    if reach == 0:
        return f"no reachable stage starts at layer 0 (stages found: {spans})"
    return f"the stages chain from layer 0 up to layer {reach - 1}, none starts at layer {reach} of {n_layer} (stages found: {spans})"


def choose_replacement(candidates: Collection[Candidate], layers: range, exclude: Collection[str] = ()) -> Candidate | None:
    """The stage to take over a lost one's *layers*: the lowest round trip among the others running exactly those."""
    same = [c for c in candidates if c.layers == layers and c.peer not in exclude]
    return min(same, key=lambda c: (c.rtt_ms, c.price, c.peer), default=None)
