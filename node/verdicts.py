"""The verdict store: which lossy wire codecs passed `moeswarm verify` for which model, on this machine.

A node's own persistent state (``$MOESWARM_HOME/verdicts.json``), so it lives in :mod:`node`, not in
the numerics: the composition root reads it once (``default_wire``, ``require_verified``) and hands
the dispatcher a codec that is already allowed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from experts.atomic import write_atomic
from experts.codecs import Codec
from experts.errors import CodecError
from experts.home import moeswarm_home


def verdict_path() -> Path:
    return moeswarm_home() / "verdicts.json"


def _load() -> dict:
    p = verdict_path()
    try:
        return json.loads(p.read_text()) if p.exists() else {}
    except ValueError:
        raise CodecError(f"verdict store {p} is corrupt; delete it and re-run `moeswarm verify`") from None


def record_verdict(digest: str, codec: Codec, verdict: str) -> None:
    p = verdict_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    data = _load()
    data.setdefault(digest, {})[codec.name.lower()] = {"verdict": verdict, "at": int(time.time())}
    write_atomic(p, json.dumps(data, indent=1, sort_keys=True))


def is_verified(digest: str, codec: Codec) -> bool:
    return not codec.lossy or _load().get(digest, {}).get(codec.name.lower(), {}).get("verdict") == "pass"


def default_wire(digest: str) -> Codec:
    """The wire a backbone uses unless told otherwise: F16 (half the bytes) once the model's F16 gate
    passed, else exact F32."""
    return Codec.F16 if is_verified(digest, Codec.F16) else Codec.F32


def require_verified(digest: str, codec: Codec) -> None:
    """Refuse a lossy codec for a model whose gate has not passed for that codec."""
    if not codec.lossy:
        return
    entry = _load().get(digest, {}).get(codec.name.lower())
    if not entry or entry.get("verdict") != "pass":
        raise CodecError(
            f"wire codec {codec.name.lower()} is not verified for model {digest[:16]}...; "
            f"run `moeswarm verify MODEL.gguf --wire {codec.name.lower()}` first (or use --wire f32)"
        )
