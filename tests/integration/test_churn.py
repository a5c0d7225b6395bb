"""A gateway under churn: its only worker for a range is killed, or a sybil announces the range and never answers; the
gateway waits on that host once, serves exact text meanwhile (the backbone computes the range), and uses the
replacement that joins."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.moe import Partition
from experts.tokenizer import Tokenizer
from node.launcher import Cluster, NodeProcess
from tests.support import until
from tests.support.engine import local_completion, local_engine

pytestmark = pytest.mark.slow
LOOPBACK_DATAGRAM = "16384"
PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "Let there be light"]
N_TOKENS = 6
TIMEOUT_S = "2"  # the gateway's --timeout: what an unmeasured host (the sybil, at first) may cost a dispatch
MAX_REQUESTS = 400  # the driver's bound, far above what a test needs


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return GGUFModel(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def part(model) -> Partition:
    return Partition.even(model.cfg.n_expert, 2)


@pytest.fixture(scope="module")
def local(model, part) -> dict[str, str]:
    """Each prompt's greedy text from single-process `generate` with the workers' grouping."""
    engine, tok = local_engine(model), Tokenizer.from_spec(model.tokenizer_spec)
    return {p: local_completion(engine, tok, part, p, N_TOKENS)[0] for p in PROMPTS}


def worker(cluster: Cluster, name: str, model: GGUFModel, boot: str, rng: tuple[int, int], **kw) -> NodeProcess:
    return cluster.start(name, "worker", "--model", str(model.path), "--experts", f"{rng[0]}-{rng[1] - 1}", "--bootstrap", boot, "--max-datagram", LOOPBACK_DATAGRAM, **kw)


def gateway(cluster: Cluster, boot: str) -> tuple[NodeProcess, str]:
    """`backbone serve` with JSON logs, a short --timeout and routes re-read every second; returns it and its /v1 URL."""
    node = cluster.start("gateway", "--log-json", "backbone", "serve", "--bootstrap", boot, "--http", "127.0.0.1:0", "--max-datagram", LOOPBACK_DATAGRAM, "--timeout", TIMEOUT_S, "--route-refresh", "1", "--no-ledger")
    return node, node.wait_ready()["base_url"]


def events(node: NodeProcess, name: str, peer: str) -> list[dict]:
    """The structlog events called *name* about *peer* in a node's JSON log."""
    found = []
    for line in node.log_file.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == name and event.get("peer") == peer:
                found.append(event)
    return found


def dispatch_stats(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=30).json()["dispatch"]


@contextlib.contextmanager
def requests_running(url: str) -> Iterator[list[tuple[str, str]]]:
    """Greedy completions one after another from a thread while the block runs; yields the (prompt, text) answered."""
    done: list[tuple[str, str]] = []
    stop = threading.Event()
    failures: list[BaseException] = []

    def drive() -> None:
        with httpx.Client(timeout=120) as client:
            for i in range(MAX_REQUESTS):
                if stop.is_set():
                    return
                prompt = PROMPTS[i % len(PROMPTS)]
                try:
                    r = client.post(url + "/completions", json={"model": "embedded", "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0})
                    r.raise_for_status()
                except httpx.HTTPError as exc:
                    failures.append(exc)
                    return
                done.append((prompt, r.json()["choices"][0]["text"]))

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join(150)
    assert not failures, failures
    assert not thread.is_alive()


def answered_since(done: list, n: int) -> bool:
    return len(done) >= n


def replace_and_check(cluster: Cluster, model, boot: str, rng, url: str, done: list) -> str:
    """Start an honest worker for *rng*; it must serve dispatches within 10 s of being ready. Returns its peer id."""
    replacement = worker(cluster, "replacement", model, boot, rng).wait_ready()["peer_id"]
    until(lambda: dispatch_stats(url)["per_peer"].get(replacement), timeout=10, interval=0.2, what="a dispatch answered by the replacement")
    n = len(done)
    until(lambda: answered_since(done, n + 2), timeout=60, interval=0.2, what="two more completions after the replacement served")
    return replacement


def test_a_killed_worker_is_waited_on_once_and_its_replacement_is_used(model, part, local, tmp_path):
    """SIGKILL the only worker of a range mid-traffic: exactly one dispatch waits on it (then it is only probed in the
    background, or banned for the receipts it never signed), every completion equals the local run (tokens computed
    from its unsigned sums are rolled back), and a replacement is used within 10 s of being ready."""
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        worker(cluster, "steady", model, boot, part.bounds[0]).wait_ready()
        victim = worker(cluster, "victim", model, boot, part.bounds[1])
        victim_id = victim.wait_ready()["peer_id"]
        gw, url = gateway(cluster, boot)
        with requests_running(url) as done:
            until(lambda: dispatch_stats(url)["per_peer"].get(victim_id), timeout=60, interval=0.2, what="the victim served")
            victim.kill()
            # Gone, it is either probed in the background or, holding receipts it never signed (the usual case under
            # traffic: signatures follow the replies), banned as a failed check would ban it: never waited on again.
            until(lambda: events(gw, "dispatch.probe_failed", victim_id) or events(gw, "receipt.unsigned", victim_id),
                  timeout=60, interval=0.2, what="the dead worker probed in the background or banned for its unsigned receipts")
            replacement = replace_and_check(cluster, model, boot, part.bounds[1], url, done)
        stats = dispatch_stats(url)
    assert stats["failed_by_peer"].get(victim_id) == 1  # the one dispatch in flight, or the first after the kill
    assert len(events(gw, "dispatch.failed", victim_id)) == 1
    assert stats["per_peer"][replacement] > 0
    assert done and all(text == local[prompt] for prompt, text in done)


def test_a_sybil_that_never_answers_is_waited_on_once_then_demoted(model, part, local, tmp_path):
    """A sybil announces a range and never answers: one dispatch waits its timeout, then the range is computed locally
    (exact text), its background probes time out until it is demoted, and an honest worker for it is used."""
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        worker(cluster, "steady", model, boot, part.bounds[0]).wait_ready()
        sybil_id = worker(cluster, "sybil", model, boot, part.bounds[1], module="tests.doubles.silent_worker").wait_ready()["peer_id"]
        gw, url = gateway(cluster, boot)
        with requests_running(url) as done:
            until(lambda: events(gw, "route.demoted", sybil_id), timeout=90, interval=0.2, what="the sybil demoted")
            replacement = replace_and_check(cluster, model, boot, part.bounds[1], url, done)
        stats = dispatch_stats(url)
    assert stats["failed_by_peer"].get(sybil_id) == 1 and stats["timeouts_by_peer"][sybil_id] == 1
    assert stats["probes"]["failed"] >= 2 and sybil_id not in stats["per_peer"]
    assert stats["per_peer"][replacement] > 0
    assert done and all(text == local[prompt] for prompt, text in done)
