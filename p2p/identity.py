"""Node identity: an Ed25519 key and the libp2p-compatible peer id derived from it.

The peer id is libp2p's: the identity multihash of the protobuf-encoded public key,
shown in base58btc ("12D3KooW..."), so the same key names the node on the DHT
(py-libp2p) and on our QUIC data path. This module never imports libp2p: importing
it patches aioquic process-wide (see docs/FIELD-NOTES.md), and the data path must not pay that.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from experts.errors import RemoteProtocolError, UsageError

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_ED25519_PROTO_PREFIX = b"\x08\x01\x12\x20"  # PublicKey{Type: Ed25519 (1), Data: 32 bytes}
_IDENTITY_MULTIHASH = b"\x00\x24"  # identity hash (0x00), 36-byte digest


class IdentityError(RemoteProtocolError):
    """A peer id or key is malformed (bytes from a peer, a record or a ledger)."""


class KeyFileError(IdentityError, UsageError):
    """This node's own key file cannot be used; the message says how to fix it."""


# A node meets few peers and names them on every dispatch (receipts, stats, logs): ~13-21 us of pure-Python
# bignum arithmetic per conversion otherwise, several per round trip.
@functools.lru_cache(maxsize=4096)
def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


@functools.lru_cache(maxsize=4096)
def _b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        i = _B58.find(ch)
        if i < 0:
            raise IdentityError(f"peer id {text!r} is not base58btc (bad character {ch!r})")
        n = n * 58 + i
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


@dataclass(frozen=True, order=True)
class PeerId:
    """A libp2p peer id for an Ed25519 key (identity multihash of the protobuf public key)."""

    raw: bytes

    @classmethod
    def from_public_bytes(cls, public: bytes) -> PeerId:
        if len(public) != 32:
            raise IdentityError(f"an Ed25519 public key has 32 bytes, got {len(public)}")
        return cls(_IDENTITY_MULTIHASH + _ED25519_PROTO_PREFIX + public)

    @classmethod
    def from_string(cls, text: str) -> PeerId:
        raw = _b58decode(text)
        if len(raw) != 38 or not raw.startswith(_IDENTITY_MULTIHASH + _ED25519_PROTO_PREFIX):
            raise IdentityError(f"peer id {text!r} is not an Ed25519 libp2p peer id (expected 12D3KooW...)")
        return cls(raw)

    @property
    def public_bytes(self) -> bytes:
        """The Ed25519 public key the id embeds: an Ed25519 peer id is its own key."""
        return self.raw[len(_IDENTITY_MULTIHASH) + len(_ED25519_PROTO_PREFIX) :]

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.public_bytes).verify(signature, data)
        except InvalidSignature:
            return False
        return True

    def __str__(self) -> str:
        return _b58encode(self.raw)

    def short(self) -> str:
        """The last 8 characters, for logs and tables."""
        return str(self)[-8:]


class Identity:
    """A node's private key with its peer id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self.private_key = private_key
        self.public_bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerId.from_public_bytes(self.public_bytes)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed (what libp2p's Ed25519 key pair is built from)."""
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load the key at *path*, or create it there with mode 0600 (owner read/write only)."""
        path = Path(path)
        if path.exists():
            mode = path.stat().st_mode & 0o777
            if mode & 0o077:
                raise KeyFileError(f"key file {path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except ValueError as exc:
                raise KeyFileError(f"key file {path} is not a PEM private key ({exc}); restore it, or move it away to create a new identity") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise KeyFileError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key; move it away to create a new identity")
            return cls(key)
        ident = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = ident.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return ident
