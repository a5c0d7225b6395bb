"""The README's two-machine walkthrough: every `moeswarm` command in it parses with the real CLI.

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


def walkthrough_commands() -> list[list[str]]:
    """The `moeswarm ...` lines of the walkthrough's sh blocks (continuations joined, env assignments and comments dropped)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Joining a swarm: two machines") : text.index("## Watching a node")]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.replace("$BOOT", BOOT), comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words and words[0] == "moeswarm":
                commands.append(words[1:])
    return commands


def test_the_walkthrough_has_every_step():
    """Bootstrap, a volunteer's join, a relay and a NAT-bound join, the gateway and the status map, in that order."""
    steps = [" ".join(c[:2]) for c in walkthrough_commands()]
    assert [s.split(" --")[0] for s in steps] == ["bootstrap", "join", "relay", "join", "backbone serve", "status"]


@pytest.mark.parametrize("args", walkthrough_commands(), ids=lambda a: " ".join(a[:2]))
def test_each_command_parses(args, monkeypatch):
    """Options, choices and the model path (relative to a clone's root, where the walkthrough runs) are accepted."""
    monkeypatch.chdir(REPO)
    parse_cli(args)
