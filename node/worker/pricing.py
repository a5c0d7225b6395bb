"""The price a worker announces: a backbone only reads the announced number (and filters by --max-price), so the rule
lives with the worker (the worker and backbone packages never import each other; tests/integration/test_imports.py)."""

from __future__ import annotations


def scarcity_price(base: int, live_replicas: int) -> int:
    """A worker's announced price per work unit: its base price, raised when few others host the same slice.

    price = base * (1 + 1/n) rounded up, n = live hosts of the slice including this one: a sole host
    asks double, one of two asks 1.5x, and the premium fades as replicas join.
    """
    n = max(live_replicas, 1)
    return -(-base * (n + 1) // n)
