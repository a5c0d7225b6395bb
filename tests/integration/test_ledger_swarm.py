"""The ledger in a real swarm: counts equal the dispatches made, tampering is caught, a killed backbone loses nothing acknowledged."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from functools import partial

import pytest

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster
from node.ledger.store import Ledger
from tests.support import MOESWARM, moeswarm, until

pytestmark = pytest.mark.slow
cli = partial(moeswarm, timeout=300)


def entry_count(path) -> int:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    finally:
        con.close()


def test_demo_ledgers_count_every_dispatch_and_catch_tampering(tmp_path):
    """After `moeswarm demo --json`, every ledger verifies and its per-peer counts equal the dispatches made."""
    env = {**os.environ, "MOESWARM_HOME": str(tmp_path)}
    p = cli("demo", "--json", "--tokens", "12", env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    demo = json.loads(p.stdout)
    backbone_ledger = demo["ledger_paths"][-1]
    show = json.loads(cli("ledger", "show", "--ledger", backbone_ledger, "--json").stdout)
    made = {w["peer_id"]: w["dispatches"] for w in demo["workers"]}
    assert all(n > 0 for n in made.values())
    assert {x["peer_id"]: x["dispatches"] for x in show["peers"]} == made
    assert show["total_dispatches"] == sum(made.values()) == demo["dispatches"]
    assert all(x["work_units"] > 0 for x in show["peers"])
    for worker, path in zip(demo["workers"], demo["ledger_paths"][:-1]):
        own = json.loads(cli("ledger", "show", "--ledger", path, "--json").stdout)
        assert own["total_dispatches"] == worker["dispatches"]
    for path in demo["ledger_paths"]:
        assert cli("ledger", "verify", "--ledger", path).returncode == 0

    con = sqlite3.connect(backbone_ledger)
    seq, rid = con.execute("SELECT seq, rowid FROM entries ORDER BY seq LIMIT 1 OFFSET 5").fetchone()
    con.execute("UPDATE entries SET bytes_in = bytes_in + 1 WHERE rowid = ?", (rid,))
    con.commit()
    con.close()
    bad = cli("ledger", "verify", "--ledger", backbone_ledger)
    assert bad.returncode == 1 and f"entry {seq}" in bad.stdout + bad.stderr


def test_backbone_killed_mid_generation_keeps_every_acknowledged_receipt(tmp_path):
    """SIGKILL the backbone while it generates: the reopened ledger verifies and holds all entries committed before."""
    ledger = tmp_path / "backbone.sqlite"
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        cluster.start("w", "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot).wait_ready()
        gen = subprocess.Popen([*MOESWARM, "backbone", "generate", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, "--tokens", "400",
                                "--ledger", str(ledger), "--data-dir", str(tmp_path / "bb"), "In the beginning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:

            def committed() -> int:
                if not ledger.exists():
                    return 0
                try:
                    return entry_count(ledger)
                except sqlite3.OperationalError:
                    return 0  # table not created yet

            until(lambda: committed() >= 40 or gen.poll() is not None, timeout=120, interval=0.2, what="40 entries")
            seen = committed()
            assert seen >= 40 and gen.poll() is None, "generation ended or stalled before the kill"
            gen.kill()
            gen.wait()
        finally:
            if gen.poll() is None:
                gen.kill()
    assert cli("ledger", "verify", "--ledger", str(ledger)).returncode == 0
    assert entry_count(ledger) >= seen


def backup(src, dst) -> None:
    """An operator's copy of a live ledger (SQLite's online backup: the WAL is included)."""
    live, copy = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        live.backup(copy)
    finally:
        live.close()
        copy.close()


def test_a_worker_ledger_restored_from_an_older_copy_is_flagged_by_its_backbone(tmp_path):
    """Backbone and worker swap signed ledger heads; after the worker's ledger is rolled back to a copy taken one
    generation earlier, the backbone's next run records the rollback as evidence and reconcile lists the lost receipts."""
    bb = tmp_path / "bb"
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        worker = cluster.start("w", "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot)
        peer = worker.wait_ready()["peer_id"]
        wled = tmp_path / "w" / "ledger.sqlite"

        def generate() -> subprocess.CompletedProcess:
            p = cli("backbone", "generate", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot, "--tokens", "4", "--data-dir", str(bb), "In the beginning")
            assert p.returncode == 0, p.stderr[-2000:]
            return p

        generate()
        backup(wled, tmp_path / "old.sqlite")
        second = generate()
        assert "rollback_detected" not in second.stdout + second.stderr
        with Ledger(bb / "ledger.sqlite") as led:
            held = led.witnessed(peer)
            assert held is not None and held.seq == entry_count(wled) and not led.conflicts()
        with Ledger(wled) as led:
            assert led.witnessed(json.loads(cli("ledger", "show", "--ledger", str(bb / "ledger.sqlite"), "--json").stdout)["owner"]) is not None

        worker.stop()
        for suffix in ("", "-wal", "-shm"):
            (tmp_path / "w" / f"ledger.sqlite{suffix}").unlink(missing_ok=True)
        backup(tmp_path / "old.sqlite", wled)
        alone = cli("ledger", "verify", "--ledger", str(wled))  # the worker's own head record names the lost entries
        assert alone.returncode == 1 and alone.stdout.startswith("lost ") and "acknowledged entries" in alone.stdout, alone
        cluster.start("w", "worker", "--model", str(EMBEDDED_MODEL), "--bootstrap", boot).wait_ready()
        third = generate()
    assert "ledger.rollback_detected" in third.stdout + third.stderr, third.stderr[-2000:]
    with Ledger(bb / "ledger.sqlite") as led:
        conflicts = led.conflicts()
    assert conflicts and conflicts[0][0] == held and conflicts[0][2] in ("rolled_back", "forked")
    found = cli("ledger", "reconcile", str(bb / "ledger.sqlite"), str(wled), "--json")
    out = json.loads(found.stdout)
    assert found.returncode == 1 and out["missing_at_worker"] and any("rolled back" in r or "forked" in r for r in out["rollbacks"]), out
