"""The CLI's error policy: a UsageError is one ``error:`` line and exit 2; anything else keeps its traceback; taken ports are UsageErrors."""

from __future__ import annotations

import socket

import click
import pytest
from click.testing import CliRunner

from experts.errors import UsageError
from node.cli.root import LazyGroup
from node.runtime import parse_hostport
from p2p.ports import PortError, check_free


@click.group(cls=LazyGroup)
def cli() -> None:
    """A root with the real error policy and two commands that fail."""


@cli.command("mistake")
def mistake_cmd() -> None:
    raise UsageError("the file x.gguf does not exist; check the path")


@cli.command("bug")
def bug_cmd() -> None:
    raise ValueError("an internal invariant broke")


def test_usage_error_is_one_line_and_exit_2():
    """A UsageError prints exactly its message after ``error:`` on stderr and exits with 2."""
    result = CliRunner().invoke(cli, ["mistake"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: the file x.gguf does not exist; check the path"]
    assert result.stdout == ""


def test_plain_value_error_keeps_its_traceback_and_exits_1():
    """A ValueError is a bug: it is not reworded as a user error, it propagates (traceback, exit 1)."""
    result = CliRunner().invoke(cli, ["bug"])
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError)
    assert "error:" not in result.output
    with pytest.raises(ValueError, match="internal invariant"):
        CliRunner().invoke(cli, ["bug"], catch_exceptions=False)


@pytest.mark.parametrize("text", ["4433", "localhost", "127.0.0.1:http", ""])
def test_bad_host_port_is_a_usage_error(text):
    """An address that is not HOST:PORT is the user's to fix: a UsageError that shows the expected form."""
    with pytest.raises(UsageError, match="must be HOST:PORT, e.g. 127.0.0.1:4433"):
        parse_hostport(text)


@cli.command("grouped")
def grouped_cmd() -> None:
    raise ExceptionGroup("trio", [ExceptionGroup("nursery", [UsageError("TCP 127.0.0.1:4001 (the DHT) is already in use")])])


@cli.command("mixed")
def mixed_cmd() -> None:
    raise ExceptionGroup("trio", [UsageError("a mistake"), ValueError("and a bug")])


def test_a_group_of_usage_errors_is_one_line_too():
    """A UsageError that trio or a TaskGroup wrapped in (nested) exception groups is still one ``error:`` line, exit 2."""
    result = CliRunner().invoke(cli, ["grouped"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: TCP 127.0.0.1:4001 (the DHT) is already in use"]


def test_a_group_with_a_bug_in_it_keeps_its_traceback():
    """A group that also holds a bug is not reworded: it propagates whole."""
    result = CliRunner().invoke(cli, ["mixed"])
    assert result.exit_code == 1 and isinstance(result.exception, ExceptionGroup)
    assert "error:" not in result.output


@pytest.mark.parametrize("proto,kind", [("TCP", socket.SOCK_STREAM), ("UDP", socket.SOCK_DGRAM)])
def test_a_taken_port_is_a_port_error_naming_it(proto, kind):
    """check_free on a port this test holds: a PortError (a UsageError) naming protocol, address and purpose."""
    with socket.socket(socket.AF_INET, kind) as held:
        held.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortError, match=rf"{proto} 127.0.0.1:{port} \(the DHT\) is already in use by another process"):
            check_free(proto, "127.0.0.1", port, "the DHT")
    check_free(proto, "127.0.0.1", port, "the DHT")  # released: free again
    with pytest.raises(PortError, match="not an address of this machine"):
        check_free(proto, "192.0.2.1", port, "QUIC")
