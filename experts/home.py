"""Where moeswarm keeps its state on this machine: ``$MOESWARM_HOME``, else ``~/.moeswarm``.

Node keys and ledgers (``<home>/<role>/``) and the codec verdict store (``<home>/verdicts.json``) all hang off this
one directory; it lives in the bottom package so that :mod:`experts` and :mod:`node` resolve it the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


def moeswarm_home() -> Path:
    """``$MOESWARM_HOME`` if set and non-empty, else ``~/.moeswarm`` (read at each call: tests and the CLI set it)."""
    return Path(os.environ.get("MOESWARM_HOME") or Path.home() / ".moeswarm")
