"""The `moeswarm` root command: logging set-up, error policy and lazy subcommands.

This module imports no subcommand: each command family lives in its own module under
:mod:`node.cli` and is imported only when it is invoked (or listed by ``--help``), so
``moeswarm ledger show`` does not pay for aiohttp, aioquic or libp2p (Click's
documented lazy-group pattern). Library code raises; only :mod:`node.cli` prints and exits.
"""

from __future__ import annotations

import os

# Before numpy loads: one BLAS thread per process is faster and steadier for the small
# matmuls of a MoE layer on few cores, and several node processes share a machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import click  # noqa: E402

from experts.errors import UsageError  # noqa: E402
from node.logs import DEFAULT_LEVEL, LEVELS, configure_logging  # noqa: E402


class LazyGroup(click.Group):
    """A group whose subcommands are ``"module:attribute"`` strings, imported on first use.

    A user-fixable error (:class:`experts.errors.UsageError`, also inside an exception group made of
    nothing else) becomes one ``error:`` line on stderr and exit code 2; anything else is a bug and keeps its
    traceback (exit 1). Library code raises UsageErrors whose message names the problem and what to do (a
    taken port: :mod:`p2p.ports`; a bootstrap that is down or has another key: :func:`p2p.dht.kademlia.probe_bootstrap`).
    """

    def __init__(self, *args, lazy_subcommands: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = lazy_subcommands or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_subcommands])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            module, attr = self.lazy_subcommands[cmd_name].split(":")
            command = getattr(importlib.import_module(module), attr)
            if not isinstance(command, click.Command):
                raise TypeError(f"{module}:{attr} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except BaseExceptionGroup as group:  # trio (libp2p's loop) and asyncio.TaskGroup raise what failed in groups
            mistakes, rest = group.split(UsageError)
            if mistakes is None or rest is not None:
                raise
            click.echo(f"error: {_first_leaf(mistakes)}", err=True)
            sys.exit(2)


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a (nested) exception group: the one line to print when all of them are mistakes."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


@click.group(
    cls=LazyGroup,
    lazy_subcommands={
        "backbone": "node.cli.swarm:backbone_group",
        "bench": "node.cli.bench:bench_group",
        "bootstrap": "node.cli.swarm:bootstrap_cmd",
        "demo": "node.cli.demo:demo_cmd",
        "fetch": "node.cli.fetch:fetch_cmd",
        "inspect": "node.cli.model:inspect_cmd",
        "join": "node.cli.join:join_cmd",
        "ledger": "node.cli.ledger:ledger_group",
        "model": "node.cli.model:model_group",
        "relay": "node.cli.relay:relay_cmd",
        "slice": "node.cli.model:slice_cmd",
        "stage": "node.cli.stage:stage_cmd",
        "status": "node.cli.status:status_cmd",
        "testbed": "node.cli.testbed:testbed_group",
        "verify": "node.cli.model:verify_cmd",
        "worker": "node.cli.swarm:worker_cmd",
    },
)
@click.option("--log-level", default=DEFAULT_LEVEL, show_default=True, type=click.Choice(LEVELS), help="info: a few lines a person wants (loading, serving, addresses, a per-minute summary, errors); debug adds per-dispatch events and other libraries' logs (libp2p's).")
@click.option("--log-json", is_flag=True, help="Logs on stderr as JSON lines only (other libraries' too), exceptions as structured data.")
def main(log_level: str, log_json: bool) -> None:
    """moeswarm: run Mixture-of-Experts models across a peer-to-peer swarm."""
    configure_logging(log_level, json_logs=log_json)


def emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))
