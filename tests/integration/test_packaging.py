"""Packaging: the project builds as a wheel without setuptools deprecation warnings (the PEP 639 license string)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_builds_without_deprecation_warnings(tmp_path):
    """`pip wheel .` succeeds and its build output names no deprecated pyproject setting."""
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert list(tmp_path.glob("moeswarm-*.whl"))
    out = p.stdout + p.stderr
    assert "is deprecated" not in out and "BuildBackendWarning: `project.license`" not in out, [line for line in out.splitlines() if "deprecat" in line.lower()]
