"""Receipts signed after the reply, in batches, by real worker processes: a worker that does not sign (or signs wrong,
or dies first) is caught, banned, unpaid on both ledgers, and the output is rolled back to the exact local tokens."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from functools import partial
from pathlib import Path

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, local_moe
from experts.generate import generate
from experts.gguf_model import GGUFModel
from experts.moe import Partition, grouped_moe
from experts.tokenizer import Tokenizer
from node.backbone.options import BackboneOptions
from node.backbone.provenance import Provenance, Rollback, exact_generate
from node.backbone.session import backbone_session, wait_for_hosts
from node.launcher import Cluster
from node.ledger.receipts import SIG_LEN
from p2p.identity import Identity
from tests.support import moeswarm, until
from tests.support.engine import kernel, local_engine

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])
cli = partial(moeswarm, timeout=600)
PROMPT = "And it came to pass"


def local_tokens(model: GGUFModel, n: int) -> list[int]:
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    bb, store = local_engine(model)
    whole = Partition(((0, model.cfg.n_expert),))
    moe = local_moe(lambda i, x, e, w: grouped_moe(store, whole, i, x, e, w))
    return [t for t, _ in generate(bb, tok.encode(PROMPT), n, moe, stop={tok.eos_id})]


def entries(path: Path) -> list[dict]:
    """A ledger's rows as dicts (read-only; an absent file has none)."""
    if not path.exists():
        return []
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM entries ORDER BY seq")]
    finally:
        con.close()


def generate_json(boot: str, tmp_path: Path, name: str, tokens: int, *extra: str) -> dict:
    p = cli("backbone", "generate", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, "--tokens", str(tokens), "--json", "--no-speculative",
            "--ledger", str(tmp_path / f"{name}.sqlite"), "--data-dir", str(tmp_path / name), *extra, PROMPT)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("mode", ["never", "forge"])
def test_a_worker_that_does_not_sign_is_caught_unpaid_and_rolled_back(tmp_path, mode):
    """A worker answering right sums but never signing their receipts (`never`: the deadline passes) or signing them
    with another key (`forge`) is convicted (banned for a forgery, benched for silence), its sums rolled back: the tokens equal the local run, and
    neither ledger holds an entry of its dispatches (both verify)."""
    model = GGUFModel(EMBEDDED_MODEL)
    want = local_tokens(model, 24)
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        worker = cluster.start("unsigning", mode, "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, module="tests.doubles.unsigning_worker", env={"PYTHONPATH": REPO})
        peer = worker.wait_ready()["peer_id"]
        run = generate_json(boot, tmp_path, "bb", 24, "--spot-check", "0", "--timeout", "2", "--wait-hosts", "1")
    assert run["token_ids"] == want
    verification = run["verification"]
    # One conviction per batch left unsigned that was not disputed already (a reply in flight at the first one is another)
    assert verification["unsigned"] >= 1 and verification["caught"] == 0 and verification["rollbacks"] >= 1, verification
    assert run["per_peer"].get(peer, 0) > 0  # its sums were used before the verdict
    assert entries(tmp_path / "bb.sqlite") == [] and entries(tmp_path / "unsigning" / "ledger.sqlite") == []
    for path in (tmp_path / "bb.sqlite", tmp_path / "unsigning" / "ledger.sqlite"):
        assert cli("ledger", "verify", "--ledger", str(path)).returncode == 0


def test_a_worker_killed_between_its_replies_and_their_signature_is_paid_only_for_what_it_signed(tmp_path):
    """An honest worker process signs a first batch, answers three more dispatches and is SIGKILLed before it signs
    them: both ledgers hold exactly the first batch (reconcile agrees), the three are disputed as unsigned and in no
    ledger, and the tokens, rolled back past the unsigned sums, equal the local run."""
    model = GGUFModel(EMBEDDED_MODEL)
    n = 12
    want = local_tokens(model, n)
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    bb_ledger, w_ledger = tmp_path / "bb.sqlite", tmp_path / "w" / "ledger.sqlite"
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        worker = cluster.start("w", "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot)
        peer = worker.wait_ready()["peer_id"]

        async def run():
            k = kernel()
            async with backbone_session(Identity.generate(), model, [boot], k, BackboneOptions(timeout=2.0, spot_check=0.0, ledger_path=bb_ledger)) as moe:
                await wait_for_hosts(moe, model.layers, 1, 60)
                moe.signatures.pending.delay = 3600.0  # batches only when settled by hand below (or at the sequence's end)
                provenance = Provenance(moe.checker.culprits, moe.settle_blocking)
                calls = []

                def hook(layer, x, ids, w):
                    calls.append(layer)
                    if len(calls) == 3:  # two dispatches answered: their batch is signed, and on the worker's disk
                        moe.settle_blocking()
                        until(lambda: len(entries(w_ledger)) == 2, timeout=30, what="the worker's ledger holds its first batch")
                    if len(calls) == 6:  # three more answered, unsigned
                        worker.kill()
                    return moe.hook(layer, x, ids, w, provenance=provenance)

                bb = Backbone(model, k)
                steps = await asyncio.to_thread(lambda: list(exact_generate(bb, tok.encode(PROMPT), n, hook, provenance, decode=generate, stop={tok.eos_id})))
                return moe, steps

        moe, steps = asyncio.run(run())
    out: list[int] = []
    for step in steps:
        if isinstance(step, Rollback):
            del out[step.keep :]
        else:
            out.append(step[0])
    assert out == want and any(isinstance(s, Rollback) for s in steps)
    signed_at_worker = [e["dispatch_id"] for e in entries(w_ledger)]
    paid = [e["dispatch_id"] for e in entries(bb_ledger) if e["kind"] == "accept"]
    assert len(signed_at_worker) == 2 and sorted(paid) == sorted(signed_at_worker)
    unsigned = [d.receipt.dispatch_id for d in moe.disputes if d.reason.startswith("unsigned")]
    assert len(unsigned) == 3 and not set(unsigned) & set(signed_at_worker) and moe.checker.unsigned == 1
    assert all(d.receipt.worker == peer for d in moe.disputes)
    for path in (bb_ledger, w_ledger):
        assert cli("ledger", "verify", "--ledger", str(path)).returncode == 0
    assert cli("ledger", "reconcile", str(bb_ledger), str(w_ledger)).returncode == 0


def test_ledgers_verify_and_reconcile_after_a_long_run_of_batch_signed_receipts(tmp_path):
    """200 tokens through two workers at the defaults: every receipt both ledgers hold carries batch evidence (a
    signature with a Merkle path), both verify, they reconcile, and each side counts every dispatch made."""
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        workers = {}
        for name, experts in (("w0", "0-15"), ("w1", "16-31")):
            node = cluster.start(name, "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, "--experts", experts)
            workers[node.wait_ready()["peer_id"]] = tmp_path / name / "ledger.sqlite"
        run = generate_json(boot, tmp_path, "bb", 200, "--wait-hosts", "2")
        for path in workers.values():  # the workers' writers commit the last batch just after signing it
            until(lambda path=path: len(entries(path)) == run["per_peer"][next(p for p, q in workers.items() if q == path)], timeout=30, what=f"{path} holds every signed receipt")
    assert run["verification"]["unsigned"] == 0 and run["verification"]["caught"] == 0
    bought = entries(tmp_path / "bb.sqlite")
    assert {e["worker"] for e in bought} == set(workers)
    for peer, path in workers.items():
        sold = entries(path)
        assert len(sold) == run["per_peer"][peer] == sum(1 for e in bought if e["worker"] == peer) > 64  # several batches
        assert all(len(e["worker_sig"]) > SIG_LEN for e in sold)
        assert cli("ledger", "verify", "--ledger", str(path)).returncode == 0
        assert cli("ledger", "reconcile", str(tmp_path / "bb.sqlite"), str(path)).returncode == 0
    assert cli("ledger", "verify", "--ledger", str(tmp_path / "bb.sqlite")).returncode == 0
    assert os.path.getsize(tmp_path / "bb.sqlite") > 0
