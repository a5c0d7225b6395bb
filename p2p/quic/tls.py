"""Certificates that bind a QUIC connection to a node's Ed25519 identity (libp2p TLS handshake spec).

https://github.com/libp2p/specs/blob/master/tls/tls.md: a node never signs X.509 with its host key. It makes a
fresh ECDSA P-256 certificate key, self-signs a certificate with it, and puts in extension
1.3.6.1.4.1.53594.1.1 the DER structure

    SignedKey ::= SEQUENCE { publicKey OCTET STRING, signature OCTET STRING }

where ``publicKey`` is the protobuf ``PublicKey`` of the host key and ``signature`` is the host key's signature over
``b"libp2p-tls-handshake:" + DER SubjectPublicKeyInfo`` of the certificate key. TLS 1.3 proves the peer holds the
certificate key (CertificateVerify over the transcript); this extension proves the host key vouches for that
certificate key; together the handshake proves the peer id. The format is the one go-, rust- and py-libp2p use, so
the same identity could later speak libp2p's own QUIC transport.

Pure functions, no sockets; the clock is passed in (``now``: Unix seconds). Host keys other than Ed25519 are refused:
our peer ids are Ed25519 only (see ``p2p.identity``).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from experts.errors import RemoteProtocolError
from p2p.identity import Identity, PeerId

EXTENSION_OID = x509.ObjectIdentifier("1.3.6.1.4.1.53594.1.1")
SIGNATURE_PREFIX = b"libp2p-tls-handshake:"
ED25519_PUBLIC_KEY_PROTO = b"\x08\x01\x12\x20"  # PublicKey{Type: Ed25519, Data: <32 bytes>}, canonical encoding
BACKDATE = 3600.0  # seconds; tolerates a peer whose clock runs behind ours
LIFETIME = 100 * 365 * 86400.0  # seconds; the key lives only in memory, as in go-libp2p
MAX_EXTENSION = 1024  # bytes; a SignedKey for an Ed25519 host key is 106

_CURVES = (ec.SECP256R1, ec.SECP384R1)
_HASHES = (hashes.SHA256, hashes.SHA384, hashes.SHA512)


class PeerCertificateError(RemoteProtocolError):
    """A certificate does not prove the peer id it claims (malformed, expired, forged or unsupported)."""


class PeerIdMismatch(PeerCertificateError):
    """A valid certificate proves a different peer id than the one we expected."""

    def __init__(self, expected: PeerId, actual: PeerId) -> None:
        super().__init__(f"expected peer {expected}, certificate proves {actual}")
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True)
class HostCertificate:
    """What an endpoint presents in its handshakes: the certificate and the certificate key (not the host key)."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey
    peer_id: PeerId


def make_certificate(identity: Identity, *, now: float) -> HostCertificate:
    """A self-signed certificate on a fresh P-256 key, carrying the host key's signature over that key."""
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    signed_key = encode_signed_key(
        ED25519_PUBLIC_KEY_PROTO + identity.public_bytes, identity.sign(SIGNATURE_PREFIX + spki)
    )
    name = x509.Name([x509.NameAttribute(x509.NameOID.SERIAL_NUMBER, str(identity.peer_id))])
    certificate = (
        x509.CertificateBuilder()
        .serial_number(int.from_bytes(os.urandom(8), "big") >> 1 or 1)
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .not_valid_before(_datetime(now - BACKDATE))
        .not_valid_after(_datetime(now + LIFETIME))
        .add_extension(x509.UnrecognizedExtension(EXTENSION_OID, signed_key), critical=True)
        .sign(key, hashes.SHA256())
    )
    return HostCertificate(certificate, key, identity.peer_id)


def verify_certificate(der: bytes, *, now: float, expected: PeerId | None = None) -> PeerId:
    """The peer id a DER certificate proves; raises ``PeerCertificateError`` (``PeerIdMismatch``) otherwise.

    This checks the certificate alone. That the peer holds the certificate key is TLS's job (CertificateVerify),
    so call this only on a certificate the TLS handshake authenticated.
    """
    try:
        cert = x509.load_der_x509_certificate(der)
    except (ValueError, x509.InvalidVersion) as exc:
        raise PeerCertificateError(f"certificate is not valid DER: {exc}") from None
    if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
        raise PeerCertificateError(
            f"certificate is valid from {cert.not_valid_before_utc} to {cert.not_valid_after_utc}, "
            f"not at {_datetime(now)}"
        )
    public_key = _check_self_signature(cert)
    peer = _peer_from_extension(cert, public_key)
    if expected is not None and peer != expected:
        raise PeerIdMismatch(expected, peer)
    return peer


def _check_self_signature(cert: x509.Certificate) -> ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey:
    try:
        public_key = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise PeerCertificateError(f"certificate key cannot be loaded: {exc}") from None
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if not isinstance(public_key.curve, _CURVES):
            raise PeerCertificateError(f"certificate key is on curve {public_key.curve.name}; want P-256 or P-384")
        try:
            digest = cert.signature_hash_algorithm
        except UnsupportedAlgorithm as exc:
            raise PeerCertificateError(f"certificate signature algorithm is not supported: {exc}") from None
        if not isinstance(digest, _HASHES):
            raise PeerCertificateError(f"certificate is signed with {digest and digest.name}; want SHA-256 or longer")
    elif not isinstance(public_key, ed25519.Ed25519PublicKey):
        raise PeerCertificateError(f"certificate key type {type(public_key).__name__} is not supported")
    try:
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as exc:
        raise PeerCertificateError(f"certificate self-signature is invalid: {exc!r}") from None
    return public_key


def _peer_from_extension(
    cert: x509.Certificate, public_key: ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
) -> PeerId:
    try:
        extensions = list(cert.extensions)
    except (ValueError, x509.DuplicateExtension, x509.UnsupportedGeneralNameType) as exc:
        raise PeerCertificateError(f"certificate extensions cannot be parsed: {exc}") from None
    ours = [e for e in extensions if e.oid == EXTENSION_OID]
    if not ours:
        raise PeerCertificateError("certificate has no libp2p public key extension (1.3.6.1.4.1.53594.1.1)")
    for ext in extensions:
        if ext.critical and ext.oid != EXTENSION_OID and isinstance(ext.value, x509.UnrecognizedExtension):
            raise PeerCertificateError(f"certificate has an unknown critical extension {ext.oid.dotted_string}")
    value = ours[0].value
    if not isinstance(value, x509.UnrecognizedExtension):  # cryptography has no parser for this OID
        raise PeerCertificateError(f"libp2p extension parsed as {type(value).__name__}")
    host_key, signature = decode_signed_key(value.value)
    if len(host_key) != len(ED25519_PUBLIC_KEY_PROTO) + 32 or not host_key.startswith(ED25519_PUBLIC_KEY_PROTO):
        raise PeerCertificateError(
            f"host key is not a canonical Ed25519 libp2p PublicKey ({len(host_key)} bytes: {host_key[:4].hex()}...)"
        )
    peer = PeerId.from_public_bytes(host_key[len(ED25519_PUBLIC_KEY_PROTO) :])
    spki = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if not peer.verify(SIGNATURE_PREFIX + spki, signature):
        raise PeerCertificateError(f"host key of {peer} did not sign this certificate's key")
    return peer


def encode_signed_key(public_key: bytes, signature: bytes) -> bytes:
    """DER ``SEQUENCE { OCTET STRING public_key, OCTET STRING signature }``."""
    body = _der(0x04, public_key) + _der(0x04, signature)
    return _der(0x30, body)


def decode_signed_key(data: bytes) -> tuple[bytes, bytes]:
    """(public_key, signature) from a DER SignedKey; strict DER, nothing may follow."""
    if len(data) > MAX_EXTENSION:
        raise PeerCertificateError(f"SignedKey is {len(data)} bytes; at most {MAX_EXTENSION}")
    body, end = _der_read(data, 0, 0x30, "SignedKey")
    if end != len(data):
        raise PeerCertificateError(f"SignedKey has {len(data) - end} trailing bytes")
    public_key, pos = _der_read(body, 0, 0x04, "SignedKey.publicKey")
    signature, pos = _der_read(body, pos, 0x04, "SignedKey.signature")
    if pos != len(body):
        raise PeerCertificateError(f"SignedKey has {len(body) - pos} bytes after its two fields")
    return public_key, signature


def _der(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        return bytes((tag, n)) + content
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((tag, 0x80 | len(size))) + size + content


def _der_read(data: bytes, pos: int, tag: int, what: str) -> tuple[bytes, int]:
    """The content of the DER element of type ``tag`` at ``pos``, and the position after it."""
    if pos + 2 > len(data):
        raise PeerCertificateError(f"{what}: truncated header")
    if data[pos] != tag:
        raise PeerCertificateError(f"{what}: tag 0x{data[pos]:02x}, want 0x{tag:02x}")
    first = data[pos + 1]
    pos += 2
    if first < 0x80:
        length = first
    else:
        n = first & 0x7F
        if n == 0 or n > 2 or pos + n > len(data):  # indefinite, absurdly long or truncated length
            raise PeerCertificateError(f"{what}: bad length encoding 0x{first:02x}")
        length = int.from_bytes(data[pos : pos + n], "big")
        if length < 0x80 or data[pos] == 0:
            raise PeerCertificateError(f"{what}: length {length} is not minimally encoded")
        pos += n
    if pos + length > len(data):
        raise PeerCertificateError(f"{what}: {length} bytes declared, {len(data) - pos} present")
    return data[pos : pos + length], pos + length


def _datetime(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc)
