"""A private CA, and a real TLS-terminating reverse proxy (Debian's nginx) in front of a plain ``ws://`` relay.

``PrivateCA`` writes a CA certificate and a leaf certificate for 127.0.0.1 signed by it, as PEM files: what an
operator with an internal CA has, and what ``--relay-ca`` is for. ``NginxProxy`` runs nginx in the foreground
(``daemon off``) with its own configuration, pid file, logs and temp directories in a test directory, listening on
one loopback port with TLS and proxying ``/relay`` (WebSocket upgrade, buffering on) to the relay; ``stop`` is
nginx's fast shutdown (SIGTERM: open connections are cut without a WebSocket close, as a crashed or restarted proxy
cuts them) and ``start`` brings it back on the same port.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support.polling import until

LOOPBACK = "127.0.0.1"


def nginx_binary() -> str | None:
    """nginx on PATH or in /usr/sbin (not on a non-root PATH on Debian); ``./dev`` installs it."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@dataclass(frozen=True)
class PrivateCA:
    """A CA certificate (``ca``) and a server certificate and key for 127.0.0.1 it signed (``cert``, ``key``)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str = "moeswarm test CA") -> PrivateCA:
        now = dt.datetime.now(dt.UTC)
        valid = (now - dt.timedelta(minutes=5), now + dt.timedelta(days=1))
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0])
            .not_valid_after(valid[1])
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, LOOPBACK)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid[0])
            .not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(LOOPBACK))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        paths = cls(directory / "ca.pem", directory / "relay-cert.pem", directory / "relay-key.pem")
        paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths.key.write_bytes(_pem(key))
        return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


CONFIG = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
events {{ worker_connections 512; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    server {{
        listen {host}:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
            proxy_pass http://{upstream};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_buffering on;
            proxy_read_timeout {read_timeout}s;  # idle WebSockets are cut after this long
        }}
    }}
}}
"""


class NginxProxy:
    """nginx terminating TLS on ``LOOPBACK:port`` for the HTTP/WebSocket server at ``upstream`` (HOST:PORT)."""

    def __init__(self, directory: Path, upstream: str, tls: PrivateCA, *, port: int | None = None, read_timeout: int = 60) -> None:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (./dev setup installs it)")
        self.binary = binary
        self.directory = directory
        self.port = port or free_port()
        self.url = f"wss://{LOOPBACK}:{self.port}/relay"
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / "nginx.conf"
        user = "user root;" if os.geteuid() == 0 else ""  # as root, workers would run as nobody: keep it simple
        self.config.write_text(CONFIG.format(user=user, dir=directory, host=LOOPBACK, port=self.port, cert=tls.cert, key=tls.key, upstream=upstream, read_timeout=read_timeout))
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NginxProxy:
        """Start nginx and wait until its port accepts connections."""
        cmd = [self.binary, "-p", str(self.directory), "-c", str(self.config), "-e", str(self.directory / "error.log")]
        with (self.directory / "stderr.log").open("ab") as err:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        until(self._listening, timeout=20, interval=0.05, what=f"nginx listening on {self.port} ({self.directory}/error.log)")
        return self

    def _listening(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise AssertionError(f"nginx exited with {self._proc.returncode}: {(self.directory / 'error.log').read_text()[-2000:]}")
        try:
            socket.create_connection((LOOPBACK, self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """Fast shutdown (SIGTERM): every connection through the proxy is cut at once."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> NginxProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
