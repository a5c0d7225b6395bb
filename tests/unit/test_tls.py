"""The libp2p TLS certificate binding: generation, verification, and every way a certificate can fail to prove an id."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from hypothesis import given
from hypothesis import strategies as st

from p2p.identity import Identity
from p2p.quic import tls

NOW = float(int(time.time()))  # X.509 times have whole seconds


def der_of(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def spki(key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def forge(
    host: Identity,
    *,
    signer: Identity | None = None,
    cert_key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | None = None,
    signed_spki: bytes | None = None,
    host_key_proto: bytes | None = None,
    extension: bool = True,
    extra: tuple[tuple[x509.ExtensionType, bool], ...] = (),
    not_before: float = NOW - 60,
    not_after: float = NOW + 3600,
    digest: hashes.HashAlgorithm | None = hashes.SHA256(),
) -> bytes:
    """A certificate built by hand, so each field can be wrong on purpose."""
    cert_key = cert_key or ec.generate_private_key(ec.SECP256R1())
    signer = signer or host
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "forged")])
    builder = (
        x509.CertificateBuilder()
        .serial_number(12345)
        .subject_name(name)
        .issuer_name(name)
        .public_key(cert_key.public_key())
        .not_valid_before(dt.datetime.fromtimestamp(not_before, dt.timezone.utc))
        .not_valid_after(dt.datetime.fromtimestamp(not_after, dt.timezone.utc))
    )
    if extension:
        proto = host_key_proto or tls.ED25519_PUBLIC_KEY_PROTO + host.public_bytes
        signature = signer.sign(tls.SIGNATURE_PREFIX + (signed_spki or spki(cert_key)))
        value = tls.encode_signed_key(proto, signature)
        builder = builder.add_extension(x509.UnrecognizedExtension(tls.EXTENSION_OID, value), critical=True)
    for ext, critical in extra:
        builder = builder.add_extension(ext, critical=critical)
    return der_of(builder.sign(cert_key, None if isinstance(cert_key, ed25519.Ed25519PrivateKey) else digest))


_FUZZ_CERT = der_of(tls.make_certificate(Identity.generate(), now=NOW).certificate)


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.generate()


def test_generated_certificate_proves_its_peer_id(alice: Identity) -> None:
    """A certificate from make_certificate verifies to the identity's peer id, with or without an expectation."""
    host = tls.make_certificate(alice, now=NOW)
    der = der_of(host.certificate)
    assert host.peer_id == alice.peer_id
    assert tls.verify_certificate(der, now=NOW) == alice.peer_id
    assert tls.verify_certificate(der, now=NOW, expected=alice.peer_id) == alice.peer_id


def test_generated_certificate_layout(alice: Identity) -> None:
    """The certificate key is a fresh P-256 key (not the host key) and the extension is critical, as go/rust do."""
    first = tls.make_certificate(alice, now=NOW)
    second = tls.make_certificate(alice, now=NOW)
    assert isinstance(first.private_key.curve, ec.SECP256R1)
    assert spki(first.private_key) != spki(second.private_key)
    ext = first.certificate.extensions.get_extension_for_oid(tls.EXTENSION_OID)
    assert ext.critical
    host_key, signature = tls.decode_signed_key(ext.value.value)
    assert host_key == tls.ED25519_PUBLIC_KEY_PROTO + alice.public_bytes
    assert alice.peer_id.verify(tls.SIGNATURE_PREFIX + spki(first.private_key), signature)


def test_other_expected_peer_is_a_mismatch(alice: Identity, bob: Identity) -> None:
    """A valid certificate for alice is refused when bob was expected, naming both ids."""
    der = der_of(tls.make_certificate(alice, now=NOW).certificate)
    with pytest.raises(tls.PeerIdMismatch) as info:
        tls.verify_certificate(der, now=NOW, expected=bob.peer_id)
    assert info.value.expected == bob.peer_id and info.value.actual == alice.peer_id
    assert str(bob.peer_id) in str(info.value)


def test_hand_built_certificate_verifies(alice: Identity) -> None:
    """The forging helper builds valid certificates by default (so the failures below are the tampered field)."""
    assert tls.verify_certificate(forge(alice), now=NOW) == alice.peer_id
    assert tls.verify_certificate(forge(alice, cert_key=ed25519.Ed25519PrivateKey.generate()), now=NOW) == alice.peer_id


def test_tampered_certificate_is_refused(alice: Identity) -> None:
    """Changing one byte of the signed part breaks the self-signature."""
    der = bytearray(der_of(tls.make_certificate(alice, now=NOW).certificate))
    position = der.find(alice.public_bytes)  # inside the extension, inside the signed TBS
    der[position] ^= 0x01
    with pytest.raises(tls.PeerCertificateError, match="self-signature"):
        tls.verify_certificate(bytes(der), now=NOW)


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
def test_every_bit_flip_is_refused_or_changes_nothing_signed() -> None:
    """Each single-bit change of a certificate is refused with PeerCertificateError, unless it leaves the signed
    part and the signature value intact (the BIT STRING's unused-bits count is not checked by cryptography)."""
    original = x509.load_der_x509_certificate(_FUZZ_CERT)
    for index in range(len(_FUZZ_CERT)):
        for bit in range(8):
            der = bytearray(_FUZZ_CERT)
            der[index] ^= 1 << bit
            try:
                tls.verify_certificate(bytes(der), now=NOW)
            except tls.PeerCertificateError:
                continue
            accepted = x509.load_der_x509_certificate(bytes(der))
            assert accepted.tbs_certificate_bytes == original.tbs_certificate_bytes, (index, bit)
            assert accepted.signature == original.signature, (index, bit)


def test_every_truncation_is_refused() -> None:
    """Every proper prefix of a certificate is refused with PeerCertificateError."""
    for end in range(len(_FUZZ_CERT)):
        with pytest.raises(tls.PeerCertificateError):
            tls.verify_certificate(_FUZZ_CERT[:end], now=NOW)


def test_extension_signed_by_another_key_is_refused(alice: Identity, bob: Identity) -> None:
    """Alice's public key with a signature made by bob's key proves nothing."""
    with pytest.raises(tls.PeerCertificateError, match="did not sign"):
        tls.verify_certificate(forge(alice, signer=bob), now=NOW)


def test_copied_extension_on_another_certificate_key_is_refused(alice: Identity) -> None:
    """An impostor who copies alice's extension onto a certificate for its own key is refused."""
    alice_key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(tls.PeerCertificateError, match="did not sign"):
        tls.verify_certificate(forge(alice, signed_spki=spki(alice_key)), now=NOW)


def test_missing_extension_is_refused(alice: Identity) -> None:
    """A certificate without the libp2p extension is refused."""
    with pytest.raises(tls.PeerCertificateError, match="no libp2p public key extension"):
        tls.verify_certificate(forge(alice, extension=False), now=NOW)


def test_validity_window_is_enforced(alice: Identity) -> None:
    """Expired and not-yet-valid certificates are refused; the window's edges are inside."""
    der = forge(alice, not_before=NOW - 100, not_after=NOW + 100)
    assert tls.verify_certificate(der, now=NOW + 100) == alice.peer_id
    for now in (NOW - 101, NOW + 101):
        with pytest.raises(tls.PeerCertificateError, match="valid from"):
            tls.verify_certificate(der, now=now)


def test_generated_certificate_tolerates_clock_skew(alice: Identity) -> None:
    """A peer whose clock is behind by less than BACKDATE still accepts a fresh certificate."""
    der = der_of(tls.make_certificate(alice, now=NOW).certificate)
    assert tls.verify_certificate(der, now=NOW - tls.BACKDATE / 2) == alice.peer_id


def test_unknown_critical_extension_is_refused_but_noncritical_ignored(alice: Identity) -> None:
    """Spec: abort on critical extensions we do not understand, ignore unknown non-critical ones."""
    unknown = x509.UnrecognizedExtension(x509.ObjectIdentifier("1.2.3.4.5"), b"\x05\x00")
    assert tls.verify_certificate(forge(alice, extra=((unknown, False),)), now=NOW) == alice.peer_id
    with pytest.raises(tls.PeerCertificateError, match="unknown critical extension 1.2.3.4.5"):
        tls.verify_certificate(forge(alice, extra=((unknown, True),)), now=NOW)


def test_non_ed25519_host_key_is_refused(alice: Identity) -> None:
    """A host key of another libp2p type (here ECDSA, type 3) is refused: our peer ids are Ed25519 only."""
    proto = b"\x08\x03\x12\x20" + alice.public_bytes
    with pytest.raises(tls.PeerCertificateError, match="not a canonical Ed25519"):
        tls.verify_certificate(forge(alice, host_key_proto=proto), now=NOW)


def test_weak_certificate_signature_is_refused(alice: Identity) -> None:
    """A certificate self-signed with SHA-224 is refused (the spec forbids hashes under 256 bits)."""
    der = forge(alice, digest=hashes.SHA224())
    with pytest.raises(tls.PeerCertificateError, match="SHA-256"):
        tls.verify_certificate(der, now=NOW)


def test_unsupported_curve_is_refused(alice: Identity) -> None:
    """A certificate key on P-521 is refused: aioquic cannot check its handshake signature."""
    with pytest.raises(tls.PeerCertificateError, match="curve"):
        tls.verify_certificate(forge(alice, cert_key=ec.generate_private_key(ec.SECP521R1())), now=NOW)


def test_signed_key_der_exact_bytes() -> None:
    """SignedKey encodes as DER SEQUENCE of two OCTET STRINGs, long lengths included."""
    assert tls.encode_signed_key(b"ab", b"c") == bytes.fromhex("3007" "04026162" "040163")
    long = tls.encode_signed_key(b"k" * 200, b"s")
    assert long[:6] == bytes.fromhex("3081ce" "0481c8")
    assert tls.decode_signed_key(long) == (b"k" * 200, b"s")


@pytest.mark.parametrize(
    "data, message",
    [
        (bytes.fromhex("3007040261620401"), "declared"),  # truncated
        (bytes.fromhex("3007040261620401630000"), "trailing"),
        (bytes.fromhex("3108040261620401 63".replace(" ", "")), "tag"),
        (bytes.fromhex("308107040261620401 63".replace(" ", "")), "minimally"),
        (bytes.fromhex("30800402616204016300 00".replace(" ", "")), "length encoding"),
        (bytes.fromhex("300904026162040163 0400".replace(" ", "")), "after its two fields"),
        (bytes.fromhex("3004 03026162".replace(" ", "")), "tag"),
    ],
)
def test_malformed_signed_key_is_refused(data: bytes, message: str) -> None:
    """Non-DER, truncated, padded or mistyped SignedKeys raise PeerCertificateError."""
    with pytest.raises(tls.PeerCertificateError, match=message):
        tls.decode_signed_key(data)


@given(st.binary(max_size=300))
def test_decode_signed_key_never_crashes(data: bytes) -> None:
    """Arbitrary bytes either decode or raise PeerCertificateError; a decoded value re-encodes to the same bytes."""
    try:
        public_key, signature = tls.decode_signed_key(data)
    except tls.PeerCertificateError:
        return
    assert tls.encode_signed_key(public_key, signature) == data


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
@given(st.binary(min_size=1, max_size=600))
def test_verify_never_crashes_on_garbage(data: bytes) -> None:
    """Arbitrary bytes are refused with PeerCertificateError, never another exception."""
    with pytest.raises(tls.PeerCertificateError):
        tls.verify_certificate(data, now=NOW)
