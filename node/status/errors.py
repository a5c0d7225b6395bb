"""The last warnings and errors this process logged, for the status page (a structlog processor fills it)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import MutableMapping
from typing import Any

KEEP = 20
RECENT: deque[dict] = deque(maxlen=KEEP)
_SKIP = {"event", "level", "timestamp", "exc_info"}


def remember_errors(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: keep a copy of each warning/error event (the event passes on unchanged)."""
    if method in ("warning", "error", "exception", "critical"):
        detail = " ".join(f"{k}={v}" for k, v in event.items() if k not in _SKIP)
        RECENT.append({"at": time.strftime("%H:%M:%S", time.gmtime()), "level": "error" if method == "exception" else method, "event": str(event.get("event")), "detail": detail[:300]})
    return event
