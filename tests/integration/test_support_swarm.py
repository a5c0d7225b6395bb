"""tests.support.swarm on real processes: clients stop first, then the workers together, then the bootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.swarm import Swarm

pytestmark = pytest.mark.slow

DOUBLE = "tests.doubles.stop_recorder"
REPO = str(Path(__file__).resolve().parents[2])


def test_a_swarm_stops_by_tier_and_each_tier_at_once(tmp_path):
    """A bootstrap, two workers and a backbone: the backbone is signalled and gone before the workers are signalled;
    both workers are signalled before either exits (sequential stopping would signal one only after the other left);
    the bootstrap is signalled after both workers exited."""
    log = tmp_path / "order.txt"
    with Swarm(tmp_path) as swarm:
        for name, command in (("boot", "bootstrap"), ("w1", "worker"), ("w2", "worker"), ("gw", "backbone")):
            swarm.start(name, command, name, str(log), module=DOUBLE, env={"PYTHONPATH": REPO}).wait_ready()
    lines = log.read_text().splitlines()
    assert sorted(lines) == sorted(f"{n} {w}" for n in ("boot", "w1", "w2", "gw") for w in ("term", "exit")), lines
    at = {line: i for i, line in enumerate(lines)}
    assert at["gw exit"] < min(at["w1 term"], at["w2 term"])
    assert max(at["w1 term"], at["w2 term"]) < min(at["w1 exit"], at["w2 exit"])
    assert max(at["w1 exit"], at["w2 exit"]) < at["boot term"]
