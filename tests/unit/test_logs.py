"""node.logs without processes: which records a level shows, and that --log-json writes JSON lines only."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import pytest
import structlog

from node.logs import configure_logging
from p2p.dht.libp2p_glue import reattach_libp2p_logger


@pytest.fixture
def output(monkeypatch):
    """A stream for configure_logging; structlog and the root logger are put back afterwards (other tests capture
    events with structlog.testing and pytest's own handler)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    libp2p = logging.getLogger("libp2p")
    libp2p_state = (libp2p.level, libp2p.propagate)
    monkeypatch.delenv("LIBP2P_DEBUG", raising=False)
    yield io.StringIO()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)
    libp2p.setLevel(libp2p_state[0])
    libp2p.propagate = libp2p_state[1]


def detached_libp2p() -> logging.Logger:
    """The ``libp2p`` logger as importing libp2p leaves it (no propagation, level WARNING), then re-attached."""
    logger = logging.getLogger("libp2p")
    logger.propagate, logger.level = False, logging.WARNING
    reattach_libp2p_logger()
    return logging.getLogger("libp2p.network.swarm")


def emit_all() -> None:
    """One of each: our events at debug, info and error, libp2p's records at debug, warning and error, asyncio's error."""
    log = structlog.get_logger("node.worker.node")
    log.debug("dispatch.served", layer=1)
    log.info("worker.ready", quic="127.0.0.1:4433")
    log.error("worker.failed", reason="disk full")
    libp2p = detached_libp2p()
    libp2p.debug("dialing peer")
    libp2p.warning("Failed to get value from peer")
    libp2p.error("redial failed: connection refused")
    logging.getLogger("asyncio").error("Task exception was never retrieved")


def test_default_level_shows_our_lines_and_no_libp2p(output):
    """At the default level (info): our info and error events and asyncio's error; none of libp2p's records, not even its errors."""
    configure_logging(stream=output)
    emit_all()
    text = output.getvalue()
    assert "worker.ready" in text and "worker.failed" in text and "Task exception was never retrieved" in text
    assert "dispatch.served" not in text
    assert "libp2p" not in text and "redial failed" not in text and "Failed to get value" not in text
    assert len(text.splitlines()) == 3


def test_debug_level_adds_libp2p_from_its_info_up(output):
    """At debug, libp2p's warning and error records show up (named by logger); its own debug records stay off."""
    configure_logging("debug", stream=output)
    emit_all()
    lines = output.getvalue().splitlines()
    libp2p_lines = [line for line in lines if "libp2p.network.swarm" in line]
    assert [("redial failed" in line, "Failed to get value" in line) for line in libp2p_lines] == [(False, True), (True, False)]
    assert not any("dialing peer" in line for line in lines)
    assert any("dispatch.served" in line for line in lines)


def test_json_lines_only_with_structured_tracebacks(output):
    """With json_logs every line is a JSON object, libp2p's too; an exception logged by us or by a stdlib logger is an
    ``exception`` list of frames, never ``exc_info``."""
    configure_logging("debug", json_logs=True, stream=output)
    emit_all()
    log = structlog.get_logger("node.gateway.server")
    try:
        {}["missing"]
    except KeyError as exc:
        log.error("gateway.request_failed", path="/v1/completions", exc_info=exc)
        detached_libp2p().exception("stream handler crashed")
    events = [json.loads(line) for line in output.getvalue().splitlines()]
    assert all(isinstance(e, dict) for e in events) and len(events) == 8
    assert {e["logger"] for e in events if "logger" in e} == {"libp2p.network.swarm", "asyncio"}
    failed = [e for e in events if e["event"] in ("gateway.request_failed", "stream handler crashed")]
    assert len(failed) == 2
    for e in failed:
        assert "exc_info" not in e
        assert e["exception"][0]["exc_type"] == "KeyError" and e["exception"][0]["frames"], e


class YieldingStream(io.StringIO):
    """A stream whose every write lets other threads run first, as a pipe to a busy reader does."""

    def write(self, s: str) -> int:
        time.sleep(0.0001)
        return super().write(s)


def test_json_lines_from_two_threads_never_share_a_line(output):
    """Our events from one thread and libp2p's records from another (the DHT's trio thread) at --log-json: every line is
    exactly one JSON object. ``print`` writes the newline separately, so two writers with separate locks interleave."""
    stream = YieldingStream()
    configure_logging("debug", json_logs=True, stream=stream)
    libp2p = detached_libp2p()
    ours = structlog.get_logger("node.worker.node")
    threads = [
        threading.Thread(target=lambda: [ours.info("dispatch.served", n=i) for i in range(300)]),
        threading.Thread(target=lambda: [libp2p.error("redial failed: %d", i) for i in range(300)]),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = [json.loads(line) for line in stream.getvalue().splitlines()]  # raises on two objects on one line
    assert sum(e["event"] == "dispatch.served" for e in events) == 300
    assert sum(e["event"].startswith("redial failed") for e in events) == 300
