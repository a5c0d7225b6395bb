"""Our libp2p TLS certificates against py-libp2p's, in a separate process (importing libp2p patches aioquic
process-wide, so it must not happen in the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_interoperates_with_py_libp2p() -> None:
    """py-libp2p's TLS certificates verify here and ours verify there, to the same peer id (separate process:
    importing libp2p patches aioquic process-wide)."""
    script = textwrap.dedent(
        """
        import time
        from cryptography import x509
        from cryptography.hazmat.primitives.serialization import Encoding
        from libp2p.crypto.ed25519 import Ed25519PrivateKey
        from libp2p.peer.id import ID
        from libp2p.security.tls import certificate as theirs
        from p2p.quic import tls
        from p2p.identity import Identity

        ident = Identity.generate()
        pem, _ = theirs.generate_certificate(Ed25519PrivateKey.new(ident.seed), theirs.create_cert_template())
        der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(Encoding.DER)
        assert tls.verify_certificate(der, now=time.time(), expected=ident.peer_id) == ident.peer_id
        ours = tls.make_certificate(ident, now=time.time()).certificate
        assert ID.from_pubkey(theirs.verify_certificate_chain([ours])).to_base58() == str(ident.peer_id)
        print("interop ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "interop ok" in result.stdout
