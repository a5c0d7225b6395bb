"""Replace a file's content in one step, safely when several writers race for the same path.

Every writer gets its own temporary name beside the target (pid and thread), so two processes or two threads writing
one path at once each rename a whole file into place and the last one wins; with one shared ``.tmp`` name the second
rename found no file (two fetch lanes staging equal bytes, two workers caching one model's leaves). Not fsynced:
callers that must survive a power cut (the ledger's archive) sync themselves.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Write *data* (text as UTF-8) to *path* by rename; a failed write leaves no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
