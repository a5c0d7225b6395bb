"""experts.home: the one place that resolves $MOESWARM_HOME."""

from __future__ import annotations

from pathlib import Path

from experts.home import moeswarm_home
from node import runtime, verdicts


def test_home_is_the_environment_variable_else_dot_moeswarm(monkeypatch, tmp_path):
    """$MOESWARM_HOME wins when set and non-empty; otherwise ~/.moeswarm."""
    monkeypatch.setenv("MOESWARM_HOME", str(tmp_path / "h"))
    assert moeswarm_home() == tmp_path / "h"
    monkeypatch.setenv("MOESWARM_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert moeswarm_home() == tmp_path / ".moeswarm"
    monkeypatch.delenv("MOESWARM_HOME")
    assert moeswarm_home() == Path(tmp_path) / ".moeswarm"


def test_node_data_and_verdicts_hang_off_the_same_home(monkeypatch, tmp_path):
    """A node's data directory and the verdict store both live under moeswarm_home()."""
    monkeypatch.setenv("MOESWARM_HOME", str(tmp_path))
    assert runtime.data_dir(None, "worker") == tmp_path / "worker"
    assert (tmp_path / "worker").is_dir()
    assert verdicts.verdict_path() == tmp_path / "verdicts.json"
