"""Packaging: the project builds as a wheel without setuptools deprecation warnings (the PEP 639 license string)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_builds_without_deprecation_warnings(tmp_path):
    """`pip wheel .` succeeds and its build output names no deprecated pyproject setting."""
    src = tmp_path / "src"  # setuptools builds in the source tree: build a copy, so the checkout stays clean
    for name in ("experts", "node", "p2p", "relay"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert list((tmp_path / "dist").glob("moeswarm-*.whl"))
    out = p.stdout + p.stderr
    assert "is deprecated" not in out and "BuildBackendWarning: `project.license`" not in out, [line for line in out.splitlines() if "deprecat" in line.lower()]
