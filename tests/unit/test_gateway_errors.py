"""The gateway's error policy: a 4xx keeps its message, a 500 logs the traceback and tells the client nothing more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from node.gateway.server import INTERNAL_ERROR, Gateway

SECRET = "disk /home/alice/prompts.db is locked"


class _BrokenStats:
    def summary(self) -> dict:
        raise RuntimeError(SECRET)


def _get(path: str) -> tuple[int, dict, list[dict]]:
    """GET ``path`` from a gateway whose engine fails on every stats read; the status, JSON body and log events."""
    engine = SimpleNamespace(stats=_BrokenStats())
    gateway = Gateway(engine, "tiny", "0" * 64)  # type: ignore[arg-type]

    async def scenario() -> tuple[int, dict]:
        async with TestClient(TestServer(gateway.app)) as client:
            resp = await client.get(path)
            return resp.status, await resp.json()

    with capture_logs() as logs:
        status, body = asyncio.run(scenario())
    return status, body, logs


def test_internal_error_is_logged_with_its_traceback_and_hidden_from_the_client():
    """A handler's exception gives a 500 with the generic message; the exception (with traceback) is in the log."""
    status, body, logs = _get("/v1/stats")
    assert status == 500
    assert body == INTERNAL_ERROR.body()
    assert SECRET not in str(body)
    [event] = [e for e in logs if e["event"] == "gateway.request_failed"]
    assert event["log_level"] == "error"
    assert isinstance(event["exc_info"], RuntimeError) and str(event["exc_info"]) == SECRET
    assert event["exc_info"].__traceback__ is not None


def test_api_error_keeps_its_message():
    """A 4xx ApiError reaches the client with its own message and is not logged as a failure."""
    status, body, logs = _get("/v1/models/other")
    assert status == 404
    assert "'other' does not exist" in body["error"]["message"]
    assert not [e for e in logs if e["event"] == "gateway.request_failed"]
