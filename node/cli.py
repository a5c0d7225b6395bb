"""The `moeswarm` command. Library code raises; only this layer prints and exits."""

from __future__ import annotations

import os

# Before numpy loads: one BLAS thread per process is faster and steadier for the small
# matmuls of a MoE layer on few cores, and several node processes share a machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import sys  # noqa: E402

import click  # noqa: E402

from experts.errors import MoeSwarmError  # noqa: E402

from .logs import configure_logging  # noqa: E402


class _Group(click.Group):
    """Turns every user-fixable error into one line on stderr and exit code 2, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MoeSwarmError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except ValueError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-json", is_flag=True, help="Structured JSON logs on stderr.")
def main(log_level: str, log_json: bool) -> None:
    """moeswarm: run Mixture-of-Experts models across a peer-to-peer swarm."""
    configure_logging(log_level, json_logs=log_json)


def emit_json(obj: dict) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))


from . import bench, bench_paths, bench_wan, cli_ledger, cli_model, cli_relay, cli_serve, cli_swarm, cli_testbed, demo  # noqa: E402  (subcommands register themselves on `main`)

__all__ = ["main", "emit_json", "bench", "bench_paths", "bench_wan", "cli_ledger", "cli_model", "cli_relay", "cli_serve", "cli_swarm", "cli_testbed", "demo"]
