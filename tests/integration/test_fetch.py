"""`moeswarm fetch` on real processes: a slice from several holders equals `moeswarm slice`'s, a corrupting holder is
caught and routed around, and a SIGKILLed fetch resumes without fetching its verified experts again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from experts.codecs import Codec
from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import ExpertRange, GGUFModel
from experts.slices import write_slice
from node.launcher import Cluster
from p2p.wire import messages as wire
from tests.support import moeswarm, until
from tests.support.dispatch import partial_sums
from tests.support.processes import MOESWARM

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])
MODEL = GGUFModel(EMBEDDED_MODEL)
LAYERS, EXPERTS = "0-3", "0-11"
EXPERT_BYTES = 32768  # one expert's rows of one tensor in the embedded model (F32 here: all alike)
# Slow enough that a fetch of ~4.7 MB from three holders takes seconds (the SIGKILL lands midway), fast enough
# for a short test: a second's worth is saved up, the rest is paced.
RATE = "300K"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap and three workers holding experts 0-3, 4-7 and 8-11 of every layer."""
    with Cluster(tmp_path_factory.mktemp("fetch")) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        holders = [cluster.start(f"w{a}", "worker", "--model", str(MODEL.path), "--experts", f"{a}-{a + 3}", "--bootstrap", boot, "--slice-rate-per-peer", RATE) for a in (0, 4, 8)]
        ready = [h.wait_ready(timeout=120) for h in holders]
        yield cluster, boot, ready


@pytest.fixture(scope="module")
def cut(tmp_path_factory) -> bytes:
    return write_slice(MODEL, range(0, 4), ExpertRange(0, 12), tmp_path_factory.mktemp("cut") / "cut.gguf").read_bytes()


def dispatch_request() -> wire.DispatchRequest:
    """Three tokens routed to experts 0-3 of layer 1 (all of them held by the first holder)."""
    x = np.random.default_rng(1).standard_normal((3, MODEL.cfg.n_embd)).astype(np.float32).tobytes()
    ids, weights = (0, 3, 1, 2, 3, 0), (0.7, 0.3, 0.5, 0.5, 0.9, 0.1)
    return wire.DispatchRequest(os.urandom(16), wire.model_id_of(bytes.fromhex(MODEL.digest)), 1, Codec.F32, 3, 2, ids, weights, x)


def fetch_args(boot: str, out: Path) -> list[str]:
    return ["fetch", "--model-digest", MODEL.digest, "--layers", LAYERS, "--experts", EXPERTS, "-o", str(out), "--bootstrap", boot, "--json"]


def fetch(boot: str, out: Path) -> dict:
    r = moeswarm(*fetch_args(boot, out), timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"stderr": r.stderr}


def test_a_slice_from_three_holders_is_the_cut_and_serves(tmp_path, swarm, cut):
    """Every holder contributes; the file is `moeswarm slice`'s byte for byte; a worker loads it (its slice check
    proves every expert against the digest again) and answers a dispatch bit for bit as a full-model holder does."""
    cluster, boot, holders = swarm
    printed = moeswarm("inspect", str(MODEL.path)).stdout.strip().splitlines()[-1]  # the trust root, as published
    assert printed.split()[1] == MODEL.digest
    out = tmp_path / "fetched.gguf"
    result = fetch(boot, out)
    assert out.read_bytes() == cut
    assert len(result["by_holder"]) == 3 and not result["dropped"]
    assert result["fetched_bytes"] == result["total_bytes"] == 4 * 3 * 12 * EXPERT_BYTES and result["resumed_bytes"] == 0
    assert not (tmp_path / "fetched.gguf.parts").exists()
    served = cluster.start("from-fetch", "worker", "--slice", str(out), "--model-digest", MODEL.digest, "--bootstrap", boot).wait_ready(timeout=120)
    request = dispatch_request()
    assert asyncio.run(partial_sums(served, request)) == asyncio.run(partial_sums(holders[0], request))  # w0: experts 0-3 of the full model


def test_a_killed_fetch_resumes_without_fetching_verified_experts_again(tmp_path, swarm, cut):
    """SIGKILL once some experts are staged; the rerun counts them as resumed and fetches exactly the rest."""
    _, boot, _ = swarm
    out = tmp_path / "resumed.gguf"
    parts = tmp_path / "resumed.gguf.parts"
    proc = subprocess.Popen([*MOESWARM, *fetch_args(boot, out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        until(lambda: parts.exists() and len(list(parts.glob("*.bin"))) >= 10, timeout=120, what="ten experts staged")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    staged = len(list(parts.glob("*.bin")))
    result = fetch(boot, out)
    assert out.read_bytes() == cut
    assert result["resumed_bytes"] == staged * EXPERT_BYTES
    assert result["fetched_bytes"] == result["total_bytes"] - staged * EXPERT_BYTES


def test_a_corrupting_holder_is_dropped_and_its_experts_come_from_the_others(tmp_path, swarm, cut):
    """A holder of every expert that flips a byte of each piece: caught on its first piece, logged, dropped; the
    slice still comes out identical."""
    cluster, boot, holders = swarm
    bad = cluster.start("corrupt", "worker", "--model", str(MODEL.path), "--experts", "0-11", "--bootstrap", boot, module="tests.doubles.corrupt_slice_worker", env={"PYTHONPATH": REPO})
    peer = bad.wait_ready(timeout=120)["peer_id"]
    try:
        out = tmp_path / "despite.gguf"
        result = fetch(boot, out)
        assert out.read_bytes() == cut
        assert list(result["dropped"]) == [peer] and "do not match the model's leaf" in result["dropped"][peer]
        assert "fetch.holder_dropped" in result["stderr"] and peer in result["stderr"]
        assert peer not in result["by_holder"]
    finally:
        bad.stop()


def test_a_digest_nobody_serves_is_one_error_line(tmp_path, swarm):
    """Another model's digest: no holder answers for it, so nothing is written; exit 2 and one line."""
    _, boot, _ = swarm
    r = moeswarm(*fetch_args(boot, tmp_path / "x.gguf")[:2], "ab" * 32, *fetch_args(boot, tmp_path / "x.gguf")[3:], timeout=120)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no worker on the DHT serves slices of model abababab" in errors[0], r.stderr
    assert not (tmp_path / "x.gguf").exists()
