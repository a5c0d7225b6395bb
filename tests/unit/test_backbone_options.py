"""BackboneOptions: one typed value from click to the session, refusing contradictions before anything starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from experts.codecs import Codec
from experts.errors import UsageError
from node.backbone.options import BackboneOptions
from node.cli.options import backbone_options, backbone_opts

DIGEST = "ab" * 32


def test_a_backbone_holding_no_experts_keeps_none_hot() -> None:
    with pytest.raises(UsageError, match="holds no experts"):
        BackboneOptions(hold_experts=False, local_experts=2)
    with pytest.raises(UsageError, match="holds no experts"):
        replace(BackboneOptions(hold_experts=False), local_memory=1 << 20)
    assert BackboneOptions(hold_experts=False).local_experts == 0


def test_spot_check_outside_zero_one_is_refused() -> None:
    with pytest.raises(UsageError, match="between 0 and 1"):
        BackboneOptions(spot_check=1.5)


def _parse(*args: str) -> BackboneOptions:
    """The options ``backbone_opts`` declares, parsed by click and built as the commands build them."""
    seen: list[BackboneOptions] = []

    @click.command()
    @backbone_opts
    def cmd(**kw) -> None:
        seen.append(backbone_options(DIGEST, Path("/tmp/l.sqlite"), **kw))

    result = CliRunner().invoke(cmd, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_the_shared_flags_build_the_value_the_commands_pass() -> None:
    o = _parse("--wire", "f16", "--timeout", "2.5", "--listen", "[::1]:7000", "--verify-all", "--local-memory", "2M", "--hedge", "--max-price", "9")
    assert (o.codec, o.timeout, o.listen, o.spot_check, o.local_memory, o.hedge, o.max_price) == (Codec.F16, 2.5, ("::1", 7000), 1.0, 2 << 20, True, 9)
    assert o.ledger_path == Path("/tmp/l.sqlite") and o.hold_experts
    defaults = _parse()
    assert defaults == replace(BackboneOptions(ledger_path=Path("/tmp/l.sqlite"), relay=defaults.relay), codec=defaults.codec)


def test_contradicting_flags_fail_before_anything_starts() -> None:
    @click.command()
    @backbone_opts
    def cmd(**kw) -> None:
        backbone_options(DIGEST, None, **kw)

    with pytest.raises(UsageError, match="holds no experts"):
        CliRunner().invoke(cmd, ["--remote-experts-only", "--local-experts", "3"], catch_exceptions=False)
    with pytest.raises(UsageError, match="HOST:PORT"):
        CliRunner().invoke(cmd, ["--listen", "nowhere"], catch_exceptions=False)
