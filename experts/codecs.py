"""Wire codecs for hidden states and partial sums (sans-IO: arrays <-> bytes).

All codecs carry a (n_tokens, dim) float32 matrix, little-endian:

========  ==========================================  =====================================
codec     layout                                      bytes for n x d
========  ==========================================  =====================================
f32       n*d float32                                 4nd
f16       n*d float16 (round to nearest even)         2nd
int8      per row, per block of 32 values: one f16     nd + 2 * n * ceil(d/32)
          scale (absmax/127), then 32 int8 values
========  ==========================================  =====================================

f32 is exact. f16 and int8 are lossy and are allowed for a model only after its
verification gate passed (see :mod:`experts.verify`).
"""

from __future__ import annotations

import enum

import numpy as np

from .errors import CodecError

INT8_BLOCK = 32


class Codec(enum.IntEnum):
    F32 = 0
    F16 = 1
    INT8 = 2

    @property
    def lossy(self) -> bool:
        return self is not Codec.F32

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            raise CodecError(f"unknown wire codec {name!r}; choose f32, f16 or int8") from None


def encoded_size(codec: Codec, n: int, d: int) -> int:
    """Exact byte count of an encoded (n, d) matrix."""
    if codec is Codec.F32:
        return 4 * n * d
    if codec is Codec.F16:
        return 2 * n * d
    return n * d + 2 * n * (-(-d // INT8_BLOCK))


def encode(codec: Codec, x: np.ndarray) -> bytes:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise CodecError(f"codecs carry (tokens, dim) matrices, got shape {x.shape}")
    if codec is Codec.F32:
        return x.astype("<f4", copy=False).tobytes()
    if codec is Codec.F16:
        return x.astype("<f2").tobytes()
    n, d = x.shape
    nb = -(-d // INT8_BLOCK)
    padded = np.zeros((n, nb * INT8_BLOCK), dtype=np.float32)
    padded[:, :d] = x
    blocks = padded.reshape(n, nb, INT8_BLOCK)
    absmax = np.abs(blocks).max(axis=-1)
    scale = (absmax / 127.0).astype("<f2")
    inv = np.divide(1.0, scale.astype(np.float32), out=np.zeros_like(absmax), where=scale > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    out = np.empty((n, nb, 2 + INT8_BLOCK), dtype=np.uint8)
    out[..., :2] = scale.view(np.uint8).reshape(n, nb, 2)
    out[..., 2:] = q.view(np.uint8)
    # Row layout is blocks of [scale, 32 values]; the last block's padding is dropped.
    flat = out.reshape(n, -1)
    keep = nb * 2 + d
    return np.ascontiguousarray(_drop_tail_padding(flat, nb, d)[:, :keep]).tobytes()


def _drop_tail_padding(flat: np.ndarray, nb: int, d: int) -> np.ndarray:
    pad = nb * INT8_BLOCK - d
    return flat if pad == 0 else flat[:, : flat.shape[1] - pad]


def decode(codec: Codec, data: bytes | memoryview, n: int, d: int) -> np.ndarray:
    """Bytes -> float32 (n, d); the length must be exact."""
    want = encoded_size(codec, n, d)
    if len(data) != want:
        raise CodecError(f"{codec.name.lower()} payload for {n}x{d} must be {want} bytes, got {len(data)}")
    if codec is Codec.F32:
        return np.frombuffer(data, dtype="<f4").reshape(n, d).astype(np.float32)
    if codec is Codec.F16:
        return np.frombuffer(data, dtype="<f2").reshape(n, d).astype(np.float32)
    nb = -(-d // INT8_BLOCK)
    pad = nb * INT8_BLOCK - d
    raw = np.frombuffer(data, dtype=np.uint8).reshape(n, -1)
    if pad:
        raw = np.concatenate([raw, np.zeros((n, pad), dtype=np.uint8)], axis=1)
    blocks = raw.reshape(n, nb, 2 + INT8_BLOCK)
    scale = np.ascontiguousarray(blocks[..., :2]).view("<f2")[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)
    out = (q * scale[..., None]).reshape(n, nb * INT8_BLOCK)[:, :d]
    if not np.isfinite(out).all():
        raise CodecError("int8 payload carries a non-finite scale")
    return np.ascontiguousarray(out)


def roundtrip(codec: Codec, x: np.ndarray) -> np.ndarray:
    """encode -> bytes -> decode: what the far side of a wire sees."""
    return decode(codec, encode(codec, x), *x.shape)
