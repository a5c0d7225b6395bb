"""Malformed request bodies against a real `backbone serve` process over raw sockets: every kind gets a 4xx with a
reason (never a 5xx, never a traceback) and writes at most one log line."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib

import pytest

from node.launcher import Cluster
from tests.support.processes import log_offset

pytestmark = pytest.mark.slow
BODY_TIMEOUT = 1.0
GOOD = json.dumps({"model": "embedded", "prompt": "And God said", "max_tokens": 1}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"


def sized(body: bytes, *headers: bytes) -> bytes:
    return HEAD + b"".join(h + b"\r\n" for h in headers) + b"Content-Length: %d\r\n\r\n" % len(body) + body


def chunked(frames: bytes, *headers: bytes) -> bytes:
    return HEAD + b"".join(h + b"\r\n" for h in headers) + b"Transfer-Encoding: chunked\r\n\r\n" + frames


# kind -> (the bytes sent, the status expected). The framing kinds are exact bytes: no HTTP client sends them.
KINDS: dict[str, tuple[bytes, int]] = {
    "gzip_garbage": (sized(b"this is not gzip", b"Content-Encoding: gzip"), 400),
    "deflate_garbage": (sized(b"this is not deflate", b"Content-Encoding: deflate"), 400),
    "gzip_trailing_garbage": (sized(gzip.compress(GOOD) + b"junk", b"Content-Encoding: gzip"), 400),
    "gzip_cut_short": (sized(gzip.compress(GOOD)[:-12], b"Content-Encoding: gzip"), 400),
    "gzip_of_invalid_utf8": (sized(gzip.compress(b'{"prompt": "\xff\xfe"}'), b"Content-Encoding: gzip"), 400),
    "chunked_gzip_garbage": (chunked(b"5\r\nhello\r\n0\r\n\r\n", b"Content-Encoding: gzip"), 400),
    "gzip_bomb": (sized(gzip.compress(b" " * (64 << 20)), b"Content-Encoding: gzip"), 413),
    "br_undecodable": (sized(b"\xff\xff not brotli", b"Content-Encoding: br"), 400),
    "zstd_undecodable": (sized(b"not zstd", b"Content-Encoding: zstd"), 400),
    "unknown_coding": (sized(zlib.compress(GOOD), b"Content-Encoding: x-squash"), 415),
    "stacked_codings": (sized(gzip.compress(gzip.compress(GOOD)), b"Content-Encoding: gzip, gzip"), 415),
    "invalid_utf8": (sized(b'{"model": "embedded", "prompt": "\xc3\x28"}'), 400),
    "lone_surrogate": (sized(b'{"model": "embedded", "prompt": "\\ud800"}'), 400),
    "empty_body": (sized(b""), 400),
    "chunked_without_last_chunk": (chunked(b"40\r\n" + GOOD[:20]), 408),
    "chunked_bad_size": (chunked(b"zz\r\nabc\r\n0\r\n\r\n"), 400),
    "chunked_size_overflow": (chunked(b"ffffffffffffffffffffff\r\nabc\r\n0\r\n\r\n"), 400),
    "content_length_past_body": (HEAD + b"Content-Length: 400\r\n\r\n" + GOOD, 408),
    "content_length_short_of_body": (HEAD + b"Content-Length: 10\r\n\r\n" + GOOD, 400),
    "content_length_not_a_number": (HEAD + b"Content-Length: 12abc\r\n\r\n" + GOOD, 400),
    "content_length_negative": (HEAD + b"Content-Length: -1\r\n\r\n" + GOOD, 400),
    "content_length_twice": (HEAD + b"Content-Length: %d\r\nContent-Length: 3\r\n\r\n" % len(GOOD) + GOOD, 400),
    "content_length_and_chunked": (HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400),
    "body_too_large": (sized(b'{"prompt": "' + b"a" * (2 << 20) + b'"}'), 413),
    "nested_too_deep": (sized(b"[" * 50_000 + b"]" * 50_000), 400),
}


def exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send *data* on a fresh connection (never half-closed: a client that sent a truncated body is still there) and
    read the first response: its status and body (by its Content-Length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            assert got, f"the connection closed without a response (got {buf!r})"
            buf += got
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length")
        while len(rest) < length:
            got = s.recv(65536)
            assert got, "the connection closed mid-response"
            rest += got
        return int(lines[0].split()[1]), rest[:length]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> dict:
    """A bootstrap and a gateway that computes every expert itself (no worker needed to read bodies)."""
    with Cluster(tmp_path_factory.mktemp("bodies")) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        node = cluster.start("gateway", "backbone", "serve", "--bootstrap", boot, "--http", "127.0.0.1:0", "--wait-hosts", "0", "--body-timeout", str(BODY_TIMEOUT))
        info = node.wait_ready()
        yield {"port": int(info["http_addr"].rsplit(":", 1)[1]), "log": node.log_file}


def test_there_are_twenty_kinds_at_least():
    assert len(KINDS) >= 20


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_malformed_body_gets_a_4xx_and_at_most_one_log_line(gateway, kind):
    """The expected 4xx with a non-empty one-line reason first; the gateway's log grows by at most one line (a
    rate-limit summary of earlier kinds aside), with no traceback and nothing at error level."""
    data, expected = KINDS[kind]
    since = log_offset(gateway["log"])
    status, body = exchange(gateway["port"], data)
    assert status == expected, (kind, status, body[:300])
    reason = json.loads(body)["error"]["message"] if body.startswith(b"{") else body.decode()
    assert reason.strip() and "Traceback" not in reason, reason
    time.sleep(0.3)  # a line written after the response would be counted too
    with gateway["log"].open("rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    own = [line for line in lines if "log.suppressed" not in line]
    assert len(own) <= 1, lines
    assert not any("Traceback" in line or "[error" in line or '"level": "error"' in line for line in lines), lines


def test_the_gateway_still_serves_after_them(gateway):
    """Last: a well-formed gzip request is answered, so none of the above broke the server."""
    status, body = exchange(gateway["port"], sized(gzip.compress(GOOD), b"Content-Encoding: gzip"))
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 1
