"""Hidden-state rows as a stage message carries them: f32 little-endian, row-major, never codec-encoded.

Shared by the stage service and the client's link so both sides read and write the same bytes (the wire module
treats the rows as opaque bytes, as it treats dispatch payloads)."""

from __future__ import annotations

import hashlib

import numpy as np

from p2p.wire import messages as wire


def rows_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f4").tobytes()


def rows_of(msg: wire.StagePass | wire.StageReply) -> np.ndarray:
    """The message's rows as a writable float32 array (n_rows, width); the counts were checked when it decoded."""
    return np.frombuffer(msg.rows, dtype="<f4").reshape(msg.n_rows, msg.width).astype(np.float32)


def session_id(session: str) -> bytes:
    """The 16 wire bytes of a client's session name (names such as a prefix cache's "s/12" are any length)."""
    return hashlib.blake2b(session.encode(), digest_size=wire.DISPATCH_ID_LEN).digest()
