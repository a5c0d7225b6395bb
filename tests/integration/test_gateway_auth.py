"""`backbone serve` with an API key, as real processes: the `openai` client with the key is served, without it or with
another it gets OpenAI's 401, and a supervisor's /healthz and /readyz stay open."""

from __future__ import annotations

import httpx
import openai
import pytest

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster

pytestmark = pytest.mark.slow
KEY = "sk-moeswarm-test-0123456789"
LOOPBACK_DATAGRAM = "16384"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> dict:
    """A bootstrap, one worker with every expert, and a gateway whose key comes from MOESWARM_API_KEY."""
    model = str(EMBEDDED_MODEL)
    with Cluster(tmp_path_factory.mktemp("auth")) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cluster.start("w0", "worker", "--model", model, "--bootstrap", boot, "--max-datagram", LOOPBACK_DATAGRAM).wait_ready()
        yield cluster.start("gateway", "backbone", "serve", "--bootstrap", boot, "--http", "127.0.0.1:0", "--max-datagram", LOOPBACK_DATAGRAM, env={"MOESWARM_API_KEY": KEY}).wait_ready()


def test_the_openai_client_with_the_key_is_served(gateway):
    """The unmodified client sends its api_key as a bearer token: models and a completion are answered."""
    client = openai.OpenAI(base_url=gateway["base_url"], api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["embedded"]
    r = client.completions.create(model="embedded", prompt="And God said", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_the_openai_client_with_another_key_gets_401(gateway):
    """A wrong key is refused with OpenAI's AuthenticationError (401, code invalid_api_key), before any generation."""
    client = openai.OpenAI(base_url=gateway["base_url"], api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model="embedded", prompt="And God said", max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert "incorrect API key" in caught.value.message


@pytest.mark.parametrize("path", ["/v1/models", "/v1/stats", "/status", "/status.json", "/metrics"])
def test_every_other_path_needs_the_key(gateway, path):
    """Without a header (or with another scheme) a path gets 401 in OpenAI's JSON shape and a Bearer challenge;
    with the key it is answered."""
    url = f"http://{gateway['http_addr']}{path}"
    for headers in ({}, {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY[:-1]}"}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_health_probes_stay_open(gateway, path):
    """A supervisor's liveness and readiness probes need no key."""
    assert httpx.get(f"http://{gateway['http_addr']}{path}").status_code == 200
