"""`backbone generate` against a silent sole host, as real processes: the host's vetting ping measured it, so the
first dispatch waits a deadline derived from that probe, not the full --timeout, and the text is the local run's."""

from __future__ import annotations

import json
import re

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.gguf_model import GGUFModel
from experts.moe import Partition
from experts.tokenizer import Tokenizer
from node.backbone.routing import DEADLINE_K, DEADLINE_MARGIN_S, UNMEASURED_COMPUTE_MS
from node.launcher import Cluster
from p2p.dht.vetting import PROBE_TIMEOUT
from tests.support.engine import local_completion, local_engine
from tests.support.processes import moeswarm

pytestmark = pytest.mark.slow
PROMPT = "And God said"
N_TOKENS = 6
TIMEOUT_S = 30.0  # --timeout: what the first dispatch waited before the probe counted


def test_a_silent_sole_host_costs_the_probes_deadline_not_the_timeout(tmp_path):
    """The only host of every expert announces, answers the vetting ping and never a dispatch: generate waits on it
    exactly once, for a deadline bounded by what a ping within PROBE_TIMEOUT predicts (well under --timeout), then
    computes locally; the tokens equal the single-process run."""
    model = GGUFModel(EMBEDDED_MODEL)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    expected, _ = local_completion(local_engine(model), tok, Partition(((0, model.cfg.n_expert),)), PROMPT, N_TOKENS)
    with Cluster(tmp_path / "nodes") as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        silent = cluster.start("silent", "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, module="tests.doubles.silent_worker").wait_ready()["peer_id"]
        run = moeswarm(
            "--log-json",
            "backbone",
            "generate",
            PROMPT,
            "--model",
            str(EMBEDDED_MODEL),
            "--tokens",
            str(N_TOKENS),
            "--bootstrap",
            boot,
            "--timeout",
            str(TIMEOUT_S),
            "--no-speculative",
            "--data-dir",
            str(tmp_path / "bb"),
            "--json",
            timeout=300,
        )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["text"] == expected and result["tokens"] == N_TOKENS
    assert result["failed_by_peer"] == {silent: 1} and result["timeouts_by_peer"] == {silent: 1}
    events = [e for e in map(_json, run.stderr.splitlines()) if e.get("event") == "dispatch.failed" and e.get("peer") == silent]
    assert len(events) == 1, events
    waited = float(re.search(r"no answer within ([0-9.]+) s", events[0]["reason"]).group(1))
    n_prompt = len(tok.encode(PROMPT))
    bound = DEADLINE_K * (PROBE_TIMEOUT + n_prompt * UNMEASURED_COMPUTE_MS / 1e3) + DEADLINE_MARGIN_S  # a ping that took its whole deadline
    assert waited <= bound < TIMEOUT_S / 4, (waited, bound)


def _json(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
