"""Parse a ``moeswarm`` command line with the real CLI (options, choices, files that must exist), without running it."""

from __future__ import annotations

import click

from node.cli.root import main as cli


def parse_cli(args: list[str]) -> click.Context:
    """The context of the command ``moeswarm ARGS`` resolves to; click's usage errors propagate."""
    cmd, name, ctx = cli, "moeswarm", None
    while isinstance(cmd, click.Group):
        ctx = cmd.make_context(name, list(args), parent=ctx)
        name, cmd, args = cmd.resolve_command(ctx, [*ctx._protected_args, *ctx.args])  # click has no public spelling
    return cmd.make_context(name, list(args), parent=ctx)
