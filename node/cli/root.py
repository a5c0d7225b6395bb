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
from node.logs import configure_logging  # noqa: E402


class LazyGroup(click.Group):
    """A group whose subcommands are ``"module:attribute"`` strings, imported on first use.

    A user-fixable error (:class:`experts.errors.UsageError`) becomes one ``error:`` line on
    stderr and exit code 2; anything else is a bug and keeps its traceback (exit 1).
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


@click.group(
    cls=LazyGroup,
    lazy_subcommands={
        "backbone": "node.cli.swarm:backbone_group",
        "bench": "node.cli.bench:bench_group",
        "bootstrap": "node.cli.swarm:bootstrap_cmd",
        "demo": "node.cli.demo:demo_cmd",
        "inspect": "node.cli.model:inspect_cmd",
        "join": "node.cli.join:join_cmd",
        "ledger": "node.cli.ledger:ledger_group",
        "model": "node.cli.model:model_group",
        "relay": "node.cli.relay:relay_cmd",
        "slice": "node.cli.model:slice_cmd",
        "status": "node.cli.status:status_cmd",
        "testbed": "node.cli.testbed:testbed_group",
        "verify": "node.cli.model:verify_cmd",
        "worker": "node.cli.swarm:worker_cmd",
    },
)
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-json", is_flag=True, help="Structured JSON logs on stderr.")
def main(log_level: str, log_json: bool) -> None:
    """moeswarm: run Mixture-of-Experts models across a peer-to-peer swarm."""
    configure_logging(log_level, json_logs=log_json)


def emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))
