"""`moeswarm backbone generate --stages auto` as a real process (issue 26): with one stage announced it says it falls
back and dispatches per layer (a worker computes the experts); with two stages covering the model it finds their
records, chains them and the tokens equal a local run bit for bit, speculative decoding (rolled-back drafts cut
every stage's KV) included."""

from __future__ import annotations

import json

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, MoeFfn, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.kernels import make_kernel
from experts.moe import Partition, grouped_moe, ungrouped_moe
from experts.slices import ExpertStore
from experts.tokenizer import Tokenizer
from tests.support.processes import moeswarm
from tests.support.swarm import Swarm

pytestmark = pytest.mark.slow
PROMPT = "And God said, Let there be light: and there was light. And God said"
N_TOKENS = 12
LOOPBACK_DATAGRAM = "16384"


def local_ids(model: GGUFModel, tok: Tokenizer, moe: str) -> list[int]:
    """Greedy ids of one process: experts in slot order (``ungrouped``, as a stage's --experts all sums them) or in
    one group (``grouped``, as one worker hosting every expert returns them)."""
    store = ExpertStore(model)
    whole = Partition(((0, model.cfg.n_expert),))
    sums = {"ungrouped": lambda i, x, e, w: ungrouped_moe(store, i, x, e, w), "grouped": lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w)}[moe]
    hook: MoeFfn = local_moe(sums)
    return [t for t, _ in generate(Backbone(model, make_kernel("reference", 1)), tok.encode(PROMPT), N_TOKENS, hook, stop={tok.eos_id})]


def generate_auto(tmp_path, boot: str, *extra: str) -> tuple[dict, list[dict]]:
    """`backbone generate --stages auto --json` against *boot*: its result and its JSON log lines."""
    run = moeswarm(
        "--log-json", "backbone", "generate", PROMPT, "--model", str(EMBEDDED_MODEL), "--tokens", str(N_TOKENS), "--bootstrap", boot, "--stages", "auto",
        "--kernel", "reference", "--threads", "1", "--max-datagram", LOOPBACK_DATAGRAM, "--spot-check", "0", "--data-dir", str(tmp_path / "client"), "--json", *extra,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout), [e for e in map(_json, run.stderr.splitlines()) if e]


def test_generate_stages_auto_falls_back_then_chains_two_stage_processes_bit_for_bit(tmp_path):
    """One stage (0-1) of four layers: one `backbone.stages_fallback` line naming layer 2, per-layer dispatch to the
    worker, the grouped local tokens. Both stages announced: the chain 0-1, 2-3 of exactly those peers, the slot-order
    local tokens, no replay, and speculative drafts verified through the chain."""
    model = GGUFModel(EMBEDDED_MODEL)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    want_staged, want_dispatched = local_ids(model, tok, "ungrouped"), local_ids(model, tok, "grouped")
    assert len(set(want_staged)) > 1
    common = ("--kernel", "reference", "--threads", "1", "--max-datagram", LOOPBACK_DATAGRAM)
    with Swarm(tmp_path) as swarm:
        boot = swarm.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        swarm.start("worker", "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, "--no-ledger", *common).wait_ready(90)
        first = swarm.start("stage1", "stage", "--model", str(EMBEDDED_MODEL), "--layers", "0-1", "--bootstrap", boot, *common).wait_ready(90)

        result, events = generate_auto(tmp_path, boot, "--stages-wait", "2")
        fallbacks = [e for e in events if e.get("event") == "backbone.stages_fallback"]
        assert len(fallbacks) == 1 and "none starts at layer 2 of 4" in fallbacks[0]["reason"], fallbacks
        assert "stages" not in result and result["token_ids"] == want_dispatched

        second = swarm.start("stage2", "stage", "--model", str(EMBEDDED_MODEL), "--layers", "2-3", "--bootstrap", boot, *common).wait_ready(90)
        result, events = generate_auto(tmp_path, boot, "--stages-wait", "30")
        assert not [e for e in events if e.get("event") == "backbone.stages_fallback"]
        assert [(s["peer"], s["layers"]) for s in result["stages"]] == [(first["peer_id"], "0-1"), (second["peer_id"], "2-3")]
        assert result["token_ids"] == want_staged and result["replays"] == 0
        assert result["speculative"]["drafter"] == "ngram" and result["speculative"]["steps"] >= 1


def _json(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
