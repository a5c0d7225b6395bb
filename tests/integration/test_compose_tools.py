"""docker-compose.yml and the container scripts checked by the tools that run them (real processes):
the compose-spec schema (check-jsonschema) and POSIX sh. The in-memory cross-reference checks are in
tests/unit/test_compose.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def test_compose_file_matches_the_compose_spec_schema():
    """check-jsonschema's vendored compose-spec schema accepts docker-compose.yml."""
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_schema_check_rejects_a_misspelled_key(tmp_path):
    """The schema check is live: a copy with `portz:` for `ports:` fails it, naming the key."""
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE.read_text()
    assert "    ports:" in text
    broken.write_text(text.replace("    ports:", "    portz:", 1))
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(broken)], capture_output=True, text=True)
    assert run.returncode == 1 and "portz" in run.stdout


@pytest.mark.parametrize("script", sorted((ROOT / "docker").rglob("*.sh")), ids=lambda p: str(p.relative_to(ROOT)))
def test_container_scripts_are_valid_sh(script):
    """Entrypoint scripts parse as POSIX sh (`sh -n`) and are executable, as the images run them."""
    run = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
