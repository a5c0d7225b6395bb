"""The `moeswarm` command line: the root group in :mod:`node.cli.root`, one module per command family."""

from node.cli.root import main

__all__ = ["main"]
