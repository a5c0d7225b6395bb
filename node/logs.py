"""structlog set-up shared by every process the CLI starts: few lines for people, JSON only when asked.

Two audiences, one stream (stderr):

* **Our events** (structlog, names like ``worker.ready``) are filtered at the chosen level. ``info``, the default,
  is the level for people: each node says what it loads, when it serves and where it is reachable, path changes,
  a per-minute summary and errors with what to do; per-dispatch and protocol events are ``debug``.
* **Other libraries' stdlib records** (libp2p's redial errors after a peer left, aiohttp, websockets...) go through
  the same root handler but are shown only at ``--log-level debug`` (their info and up): they describe those libraries' internals,
  and a worker whose peer left printed 1,735 of them in 15 minutes. The exception is the ``asyncio`` logger's
  warnings and errors ("Task exception was never retrieved"): they are bugs of ours, shown at any level.

``json_logs``: every line is one JSON object, ours and the libraries' alike (stdlib records are rendered by
structlog's ``ProcessorFormatter``), and an exception is structured data (``dict_tracebacks``: an ``exception``
list of frames), never a bare ``"exc_info": true``.

Both paths end in one :class:`structlog.WriteLogger` per stream: one lock and one ``write(line + "\\n")`` per line.
structlog's ``PrintLogger`` and a stdlib ``StreamHandler`` each lock only themselves, and ``print`` writes the
newline separately, so a libp2p record from the DHT's thread could land between one of our lines and its newline:
two JSON objects on one line.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from node.status.errors import remember_errors

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"
OWN_STDLIB_LOGGERS = ("asyncio",)  # stdlib loggers whose warnings report our bugs; the rest is third-party


class ThirdPartyToDebug(logging.Filter):
    """Which stdlib records to show at our *level*: :data:`OWN_STDLIB_LOGGERS`' warnings and up at any level; other
    libraries' records only at debug, and then their info and up (a busy libp2p node logs ~1,000 debug records a
    second; ``LIBP2P_DEBUG`` turns those on through libp2p's own handlers)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if any(record.name == n or record.name.startswith(n + ".") for n in OWN_STDLIB_LOGGERS):
            return record.levelno >= max(self.level, logging.WARNING)
        return self.level <= logging.DEBUG and record.levelno >= logging.INFO


def _renderer(json_logs: bool) -> list[Any]:
    # ConsoleRenderer prints exc_info as a traceback itself; for JSON it becomes a structured "exception" field.
    return [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()] if json_logs else [structlog.dev.ConsoleRenderer(colors=False)]


class _LineHandler(logging.Handler):
    """A stdlib handler that writes each formatted record through *sink*, the structlog logger of the same stream, so
    the two share its lock (see the module docstring)."""

    def __init__(self, sink: structlog.WriteLogger) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.msg(self.format(record))
        except Exception:  # logging's contract: a failing handler reports through handleError, never raises
            self.handleError(record)


def configure_logging(level: str = DEFAULT_LEVEL, *, json_logs: bool = False, stream: Any = None) -> None:
    """Route structlog and stdlib logging to *stream* (default stderr) at *level*, as the module docstring says."""
    lvl = getattr(logging, level.upper())
    out = stream if stream is not None else sys.stderr
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            remember_errors,  # the status page's "recent errors" (ours only: the libraries' would flood it)
            stamp,
            *_renderer(json_logs),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = _LineHandler(structlog.WriteLogger(out))
    handler.addFilter(ThirdPartyToDebug(lvl))
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, stamp],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_renderer(json_logs)],
        )
    )
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
