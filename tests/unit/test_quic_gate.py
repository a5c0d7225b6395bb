"""The Initial gate (p2p.quic.gate): the table of its docstring, row by row, and its refusal counter."""

from __future__ import annotations

import pytest

from p2p.quic.gate import Admit, InitialGate

CAP = 4


@pytest.mark.parametrize(
    ("token", "routable", "half_open", "expected"),
    [
        (None, True, CAP - 1, Admit.ACCEPT),
        (None, True, CAP, Admit.RETRY),
        (None, False, CAP, Admit.DROP),
        (True, True, CAP, Admit.ACCEPT),
        (True, True, 2 * CAP - 1, Admit.ACCEPT),
        (True, True, 2 * CAP, Admit.DROP),
        (False, True, 0, Admit.DROP),
    ],
)
def test_the_table(token, routable, half_open, expected):
    """No token: accepted below the cap, Retry above (dropped if relayed); a valid token: a second share; invalid: never."""
    assert InitialGate(CAP).admit(token=token, routable=routable, half_open=half_open, now=0.0) is expected


def test_refusals_are_counted_every_time():
    """Every refusal past the cap counts (the log shows the count at most once a second)."""
    gate = InitialGate(CAP)
    for i in range(100):
        gate.admit(token=None, routable=True, half_open=CAP, now=i / 1000)
    gate.admit(token=None, routable=True, half_open=0, now=1.0)
    assert gate.refused == 100


def test_the_cap_must_be_positive():
    """A gate that admits nobody is a configuration mistake."""
    with pytest.raises(ValueError):
        InitialGate(0)
