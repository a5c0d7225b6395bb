"""Spot checks catch a worker process that returns perturbed partial sums; it stops receiving work, and goes unpaid."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
import structlog

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.speculative import speculative_generate
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from node.ledger.store import Ledger
from p2p.identity import Identity
from tests.support import moeswarm
from tests.support.engine import kernel, local_completion, local_engine

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])
cli = partial(moeswarm, timeout=600)
PROMPT = "And it came to pass"
N_TOKENS = 160  # ~30 passes with speculation, ~120 dispatches: a cheat answering all of them escapes a 10% sample with p ~ 3e-6


def test_malicious_worker_is_caught_disputed_and_banned(tmp_path):
    """At a 10% sampling rate the cheat is caught within 100 dispatches, its receipts disputed, and it gets no more work."""
    model = GGUFModel(EMBEDDED_MODEL)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode("And it came to pass")
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cheat = cluster.start("cheat", "worker", "--model", str(model.path), "--bootstrap", boot, module="tests.doubles.malicious_worker", env={"PYTHONPATH": REPO})
        peer = cheat.wait_ready()["peer_id"]

        async def run():
            k = kernel()  # the cheat's kernel (it is the real worker's): its sums are checked bit for bit
            async with backbone_session(Identity.generate(), model, [boot], k, BackboneOptions(timeout=3.0, spot_check=0.1, spot_seed=7)) as moe:
                await wait_for_hosts(moe, model.layers, 1, 60)
                bb = Backbone(model, k)
                await asyncio.to_thread(lambda: list(generate(bb, ids, 40, moe.hook)))
                return moe

        with structlog.testing.capture_logs() as logs:
            moe = asyncio.run(run())
    to_cheat = [r for r in moe.stats.records if r.peer == peer]
    disputes = [e for e in logs if e["event"] == "receipt.disputed"]
    assert disputes and {e["peer"] for e in disputes} == {peer}
    assert moe.disputes[0].receipt.worker == peer
    assert len(to_cheat) <= 100  # caught within 100 dispatches
    assert all(r.at <= moe.disputes[0].at for r in to_cheat)  # no work after the first dispute
    assert moe.stats.local_groups > 0  # its experts were computed by the backbone after the ban
    assert all(r.worker != peer for r in moe.receipts)  # every receipt of the cheat is disputed, none paid
    assert len(moe.disputes) == len([r for r in to_cheat if r.ok])


def test_cheat_among_replicas_is_caught_unpaid_and_the_output_exact_at_the_defaults(tmp_path):
    """`backbone generate --remote-experts-only` at its default spot-check rate, 2 honest replicas + 1 cheat of every expert:
    the cheat is caught by re-asking a replica, its receipts are all disputed, and the tokens equal the run without it."""
    model = GGUFModel(EMBEDDED_MODEL)

    def generate_remote(boot: str, n_hosts: int, name: str) -> dict:
        p = cli("backbone", "generate", "--model", str(model.path), "--bootstrap", boot, "--tokens", str(N_TOKENS), "--json", "--remote-experts-only",
                "--wait-hosts", str(n_hosts), "--kernel", "ggml", "--threads", "1", "--ledger", str(tmp_path / f"{name}.sqlite"), "--data-dir", str(tmp_path / name), PROMPT)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout)

    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        # The honest replicas ask a price and the cheat none, so it is every dispatch's first choice until it is caught.
        honest = [cluster.start(f"honest{i}", "worker", "--model", str(model.path), "--bootstrap", boot, "--price", "5") for i in range(2)]
        honest_peers = {w.wait_ready()["peer_id"] for w in honest}
        clean = generate_remote(boot, 2, "clean")
        cheat = cluster.start("cheat", "worker", "--model", str(model.path), "--bootstrap", boot, module="tests.doubles.malicious_worker", env={"PYTHONPATH": REPO})
        cheat_peer = cheat.wait_ready()["peer_id"]
        run = generate_remote(boot, 3, "attacked")
    bb, store = local_engine(model)
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(PROMPT)
    whole = Partition(((0, model.cfg.n_expert),))  # each worker hosts every expert: one group per layer
    local = [t for t, _ in speculative_generate(bb, ids, N_TOKENS, local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w)), stop={Tokenizer.from_spec(model.tokenizer_spec).eos_id})]
    assert clean["token_ids"] == local  # the honest swarm, its replicas cross-checked, is exact
    assert clean["verification"]["caught"] == 0 and clean["verification"]["checked"] > 0
    assert run["token_ids"] == clean["token_ids"]
    verification = run["verification"]
    assert verification["caught"] == 1 and verification["spot_check"] == 0.1 and verification["unverifiable"] == 0, (verification, run["per_peer"], run.get("speculative"), cheat_peer)
    assert run["per_peer"][cheat_peer] > 0 and set(run["per_peer"]) == honest_peers | {cheat_peer}
    totals = {t.peer_id: t for t in Ledger(tmp_path / "attacked.sqlite").totals()}
    assert totals[cheat_peer].disputed == totals[cheat_peer].dispatches > 0 and totals[cheat_peer].work_units == 0  # unpaid
    assert all(totals[p].disputed == 0 and totals[p].work_units > 0 for p in honest_peers)
    # Its answers before the catch were used unchecked: cut back and decoded again (none if its very first answer was the one checked).
    assert (verification["rollbacks"] == 1) == (totals[cheat_peer].dispatches > 1)
    assert verification["tokens_redecoded"] <= verification["rollbacks"] * N_TOKENS


def test_gateway_rolls_a_caught_cheat_back_and_sends_only_the_honest_text(tmp_path):
    """`backbone serve` with a cheat as the only worker, one streamed and one plain request batched together: the
    spot check (seeded: the 36th dispatch, after the cheat's sums were used) catches it, both sequences roll back, and
    the streamed chunks and the plain text equal the honest run (a streamed chunk is sent only once it is final)."""
    model = GGUFModel(EMBEDDED_MODEL)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    whole = Partition(((0, model.cfg.n_expert),))
    engine = local_engine(model)
    prompts = ["And it came to pass", "In the beginning"]
    want = [local_completion(engine, tok, whole, p, 48)[0] for p in prompts]
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cluster.start("cheat", "worker", "--model", str(model.path), "--bootstrap", boot, module="tests.doubles.malicious_worker", env={"PYTHONPATH": REPO}).wait_ready()
        gw = cluster.start("gateway", "backbone", "serve", "--bootstrap", boot, "--http", "127.0.0.1:0", "--spot-seed", "0").wait_ready()
        client = openai.OpenAI(base_url=gw["base_url"], api_key="unused", max_retries=0, timeout=120)

        def streamed() -> str:
            chunks = client.completions.create(model="embedded", prompt=prompts[0], max_tokens=48, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        def plain() -> str:
            return client.completions.create(model="embedded", prompt=prompts[1], max_tokens=48, temperature=0).choices[0].text or ""

        with ThreadPoolExecutor(2) as pool:
            got = [f.result() for f in [pool.submit(streamed), pool.submit(plain)]]
        verification = httpx.get(gw["base_url"] + "/stats").json()["verification"]
    assert got == want
    assert verification["caught"] == 1 and verification["rollbacks"] >= 1, verification
