"""The two-machine walkthrough (docs/joining.md) and the README's examples: every `moeswarm` command parses with the real CLI.

The commands were run end to end on loopback when the walkthrough was written (its `#` lines are their output);
this keeps them from going stale as options change."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.support.cli import parse_cli

REPO = Path(__file__).resolve().parents[2]
BOOT = "/ip4/203.0.113.5/tcp/4001/p2p/12D3KooWBGYddkxj1hTtqzHJxVF3VBRJmYfHYyWuS5ZTpwjhyb39"


def sh_commands(page: str) -> list[list[str]]:
    """The `moeswarm ...` lines of a page's sh blocks (continuations joined, env assignments and comments dropped)."""
    text = (REPO / page).read_text()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.replace("$BOOT", BOOT), comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words and words[0] == "moeswarm":
                commands.append(words[1:])
    return commands


def walkthrough_commands() -> list[list[str]]:
    return sh_commands("docs/joining.md")


def test_the_walkthrough_has_every_step():
    """Bootstrap, a volunteer's join, a relay and a NAT-bound join, the gateway and the status map, in that order."""
    steps = [" ".join(c[:2]) for c in walkthrough_commands()]
    assert [s.split(" --")[0] for s in steps] == ["bootstrap", "join", "relay", "join", "backbone serve", "status"]


@pytest.mark.parametrize("args", walkthrough_commands(), ids=lambda a: " ".join(a[:2]))
def test_each_command_parses(args, monkeypatch):
    """Options, choices and the model path (relative to a clone's root, where the walkthrough runs) are accepted."""
    monkeypatch.chdir(REPO)
    parse_cli(args)


@pytest.mark.parametrize("args", sh_commands("README.md"), ids=lambda a: " ".join(a[:2]))
def test_each_readme_example_parses(args, monkeypatch):
    """The README's one example per role uses options the CLI has (it is not run: that is the walkthrough's job)."""
    monkeypatch.chdir(REPO)
    parse_cli(args)


def test_the_readme_has_an_example_per_role():
    """Bootstrap, join, worker, relay, backbone, gateway, ledger and testbed each have an example on the first page."""
    roles = {" ".join(c[:2]) if c[0] in ("backbone", "ledger") else c[0] for c in sh_commands("README.md")}
    assert {"bootstrap", "join", "worker", "relay", "backbone generate", "backbone serve", "ledger show", "testbed"} <= roles
