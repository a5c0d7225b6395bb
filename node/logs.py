"""structlog set-up shared by every process the CLI starts."""

from __future__ import annotations

import logging
import sys

import structlog

from node.status.errors import remember_errors


def configure_logging(level: str = "warning", *, json_logs: bool = False) -> None:
    """Route structlog (and stdlib loggers such as libp2p's) to stderr at *level*."""
    lvl = getattr(logging, level.upper())
    # ConsoleRenderer prints an event's exc_info as a traceback itself; JSON needs it formatted into a field first.
    renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] if json_logs else [structlog.dev.ConsoleRenderer(colors=False)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            remember_errors,  # the status page's "recent errors"
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
