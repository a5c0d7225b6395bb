"""Node identity: persisted Ed25519 key (mode 0600) and libp2p-compatible peer ids."""

from __future__ import annotations

import os
import stat

import pytest

from p2p.identity import Identity, IdentityError, PeerId


def test_key_is_persisted_with_mode_0600_and_reloaded(tmp_path):
    """The key file is created owner-only and the same peer id comes back on reload."""
    path = tmp_path / "node" / "key.pem"
    a = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load_or_create(path).peer_id == a.peer_id
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(path)


def test_peer_id_text_matches_libp2p():
    """Our base58 peer id equals py-libp2p's for the same Ed25519 key, and parses back."""
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.peer.id import ID

    ident = Identity.generate()
    theirs = ID.from_pubkey(Ed25519PrivateKey.from_bytes(ident.seed).get_public_key()).to_base58()
    assert str(ident.peer_id) == theirs and theirs.startswith("12D3KooW")
    assert PeerId.from_string(theirs) == ident.peer_id


def test_signatures_and_bad_ids():
    """A signature verifies only for its data and key; malformed ids are refused with a reason."""
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"data")
    assert a.peer_id.verify(b"data", sig)
    assert not a.peer_id.verify(b"datb", sig)
    assert not b.peer_id.verify(b"data", sig)
    for bad in ("", "0OIl", "12D3KooW", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"):
        with pytest.raises(IdentityError):
            PeerId.from_string(bad)
