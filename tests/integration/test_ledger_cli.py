"""The ledger in real processes: a writer SIGKILLed mid-loop keeps what it acknowledged; `moeswarm ledger` commands."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from node.ledger.receipts import Receipt, sign
from node.ledger.store import Ledger
from node.logs import configure_logging
from p2p.identity import Identity
from tests.support import moeswarm
from tests.unit.test_ledger import fill_backbone, make_receipt

ROOT = Path(__file__).resolve().parents[2]


# -- crash safety, in a real process


def crash_child(path: str) -> None:
    """Append receipts forever, printing each acknowledged seq and dispatch id (run in a child process)."""
    configure_logging("warning")  # stdout carries only acknowledgements
    backbone = Identity.load_or_create(Path(path).parent / "backbone.pem")
    worker = Identity.generate()
    with Ledger(path, "backbone", backbone) as led:
        for i in range(1_000_000):
            entry = led.append_receipt(*make_receipt(worker, backbone, i))
            print(entry.seq, entry.event.ref.dispatch_id, flush=True)


def test_entries_acknowledged_before_sigkill_survive(tmp_path):
    """A writer SIGKILLed mid-loop leaves a ledger that verifies and holds every entry it acknowledged."""
    path = tmp_path / "led" / "ledger.sqlite"
    path.parent.mkdir()
    code = f"from tests.integration.test_ledger_cli import crash_child; crash_child({str(path)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        while len(acked) < 40:
            line = child.stdout.readline()
            assert line, "the writer died before acknowledging 40 entries"
            acked.append(line.split())
        os.kill(child.pid, signal.SIGKILL)
        acked += [line.split() for line in child.stdout]  # acknowledged before the kill landed
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    with Ledger(path) as led:
        assert led.verify().ok
        stored = {(str(e.seq), e.event.ref.dispatch_id) for e in led.entries()}
        assert set(map(tuple, acked)) <= stored and len(stored) in (len(acked), len(acked) + 1)


# -- the command line, in real processes


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return moeswarm("ledger", *args, cwd=ROOT, timeout=60)


def test_cli_show_verify_export(tmp_path, parties):
    """show --json totals, verify ok, export to files; the default path is $MOESWARM_HOME/backbone/ledger.sqlite."""
    backbone, w1, w2 = parties
    path = Path(os.environ["MOESWARM_HOME"]) / "backbone" / "ledger.sqlite"
    rs = fill_backbone(path, backbone, w1, w2)
    shown = run_cli("show", "--json")
    assert shown.returncode == 0, shown.stderr
    out = json.loads(shown.stdout)
    assert out["total_dispatches"] == 5 and out["role"] == "backbone" and out["owner"] == str(backbone.peer_id)
    peers = {p["peer_id"]: p for p in out["peers"]}
    assert peers[str(w1.peer_id)] == {"peer_id": str(w1.peer_id), "role": "worker", "dispatches": 3,
                                      "work_units": rs[0].work_units + rs[2].work_units,
                                      "credits": 2 * (rs[0].work_units + rs[2].work_units), "disputed": 1}  # fmt: skip
    table = run_cli("show", "--peer", str(w2.peer_id), "--since", "2023-11-14T00:00:00Z", "--ledger", str(path))
    assert table.returncode == 0 and str(w2.peer_id) in table.stdout and str(w1.peer_id) not in table.stdout
    ok = run_cli("verify")
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 7 entries"), ok
    for fmt in ("csv", "jsonl"):
        done = run_cli("export", "--format", fmt, "-o", str(tmp_path / f"out.{fmt}"))
        assert done.returncode == 0 and "exported 7 entries" in done.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 7 == len((tmp_path / "out.csv").read_text().splitlines()) - 1


def test_cli_verify_names_the_first_bad_entry_and_errors_are_one_line(tmp_path, parties):
    """A tampered ledger exits 1 naming the entry; a missing file or non-ledger is one error line, no traceback."""
    backbone, w1, w2 = parties
    path = tmp_path / "b.sqlite"
    fill_backbone(path, backbone, w1, w2)
    con = sqlite3.connect(path)
    con.execute("UPDATE entries SET price = 1 WHERE seq = 4")
    con.commit()
    con.close()
    bad = run_cli("verify", "--ledger", str(path))
    assert bad.returncode == 1 and bad.stdout.strip().startswith("entry 4: ") and len(bad.stdout.splitlines()) == 1
    (tmp_path / "notes.txt").write_text("hello " * 100)
    for target, message in ((tmp_path / "missing.sqlite", "no ledger at"), (tmp_path / "notes.txt", "not a moeswarm ledger")):
        err = run_cli("show", "--ledger", str(target))
        assert err.returncode == 2 and message in err.stderr and len(err.stderr.splitlines()) == 1, err
        assert "Traceback" not in err.stderr


def test_a_damaged_page_is_one_error_line_for_show_and_export(tmp_path, parties):
    """Garbage written over the entries table's page of a real ledger file: `show` and `export` print one error
    line (exit 2, no traceback) that points to `verify`, and `verify` names the entry it cannot read (exit 1)."""
    backbone, w1, w2 = parties
    path = tmp_path / "b.sqlite"
    fill_backbone(path, backbone, w1, w2)
    con = sqlite3.connect(path)
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    [root] = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'entries'").fetchone()
    con.close()
    assert not Path(f"{path}-wal").exists()  # the last close checkpointed: every entry is in the main file
    with path.open("r+b") as f:
        f.seek((root - 1) * page_size + 100)  # past the page header: the cells hold the entries
        f.write(b"\xde\xad\xbe\xef" * 200)
    for args in (("show",), ("show", "--json"), ("export", "--format", "jsonl")):
        err = run_cli(*args, "--ledger", str(path))
        assert err.returncode == 2 and len(err.stderr.splitlines()) == 1 and not err.stdout, err
        assert err.stderr.startswith(f"error: {path} is damaged") and "ledger verify" in err.stderr, err
    bad = run_cli("verify", "--ledger", str(path))
    assert bad.returncode == 1 and "unreadable" in bad.stdout and "Traceback" not in bad.stderr, bad


def test_cli_compact_keeps_verify_and_totals_and_still_catches_an_edit(tmp_path):
    """`ledger compact` with the owner's key beside the ledger: verify ok, same totals by peer and day, an edit of a
    kept entry still fails verify; without the key it is one error line."""
    home = Path(os.environ["MOESWARM_HOME"]) / "backbone"
    backbone, w1, w2 = Identity.load_or_create(home / "key.pem"), Identity.generate(), Identity.generate()
    path = home / "ledger.sqlite"
    fill_backbone(path, backbone, w1, w2)  # 7 entries recorded in 2023: settled by the dispute window
    with Ledger(path, identity=backbone) as led:
        r, _ = make_receipt(w1, backbone, 50)
        fresh = Receipt(**{**r.__dict__, "issued_at_us": time.time_ns() // 1000})
        led.append_receipt(fresh, sign(w1, fresh))
    before = json.loads(run_cli("show", "--json").stdout)
    done = run_cli("compact", "--older-than", "7d")
    assert done.returncode == 0 and done.stdout.startswith("archived 7 entries") and "kept 1" in done.stdout, done
    assert list((home / "archive").glob("ledger-1-7.jsonl.gz"))
    ok = run_cli("verify")
    assert ok.returncode == 0 and "entries 1-7 archived" in ok.stdout, ok
    after = json.loads(run_cli("show", "--json").stdout)
    assert after["archived_through"] == 7 and {k: after[k] for k in ("peers", "days")} == {k: before[k] for k in ("peers", "days")}
    by_day = run_cli("show", "--by-day")
    assert "2023-11-14" in by_day.stdout and "work unit" in by_day.stdout, by_day
    again = run_cli("compact", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["archived"] == 0
    con = sqlite3.connect(path)
    con.execute("UPDATE entries SET price = 1 WHERE seq = 8")
    con.commit()
    con.close()
    bad = run_cli("verify")
    assert bad.returncode == 1 and bad.stdout.startswith("entry 8: "), bad
    (home / "key.pem").rename(home / "moved.pem")
    err = run_cli("compact")
    assert err.returncode == 2 and err.stderr.startswith("error: ") and "--key" in err.stderr and len(err.stderr.splitlines()) == 1, err
    short = run_cli("compact", "--older-than", "10m", "--key", str(home / "moved.pem"))
    assert short.returncode == 2 and "at least 1h" in short.stderr, short


def test_cli_reconcile_flags_a_ledger_rolled_back_to_an_older_copy(tmp_path, parties):
    """Each side's ledger restored from a copy taken after 3 of 5 dispatches still verifies on its own; reconcile
    against the counterparty lists the 2 lost receipts (exit 1); two ledgers of one role are one error line."""
    backbone, worker, _ = parties
    b, w = tmp_path / "backbone.sqlite", tmp_path / "worker.sqlite"
    with Ledger(b, "backbone", backbone) as bled, Ledger(w, "worker", worker) as wled:
        for i in range(5):
            if i == 3:
                for src in (b, w):  # the operator's backup (SQLite's online backup: the WAL is included)
                    with sqlite3.connect(src) as live, sqlite3.connect(tmp_path / f"{src.stem}-old.sqlite") as copy:
                        live.backup(copy)
            r, stamp = make_receipt(worker, backbone, i)
            bled.append_receipt(r, stamp)
            wled.append_receipt(r, stamp)
    ids = [make_receipt(worker, backbone, i)[0].dispatch_id for i in (3, 4)]
    same = run_cli("reconcile", str(b), str(w))
    assert same.returncode == 0 and same.stdout.startswith("5 dispatches") and "ok: both ledgers" in same.stdout, same
    for old, side in (("worker-old.sqlite", "worker"), ("backbone-old.sqlite", "backbone")):
        assert run_cli("verify", "--ledger", str(tmp_path / old)).returncode == 0  # a rollback verifies by itself
        pair = (str(b), str(tmp_path / old)) if side == "worker" else (str(tmp_path / old), str(w))
        found = run_cli("reconcile", *pair, "--json")
        out = json.loads(found.stdout)
        assert found.returncode == 1 and not out["ok"] and out[f"missing_at_{side}"] == ids, found
    twice = run_cli("reconcile", str(b), str(tmp_path / "backbone-old.sqlite"))
    assert twice.returncode == 2 and "both ledgers are backbone ledgers" in twice.stderr, twice
