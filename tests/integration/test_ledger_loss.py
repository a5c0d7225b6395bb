"""A ledger knows when it lost acknowledged entries: real writer processes, SIGKILL, real SQLite WAL damage, `ledger verify`."""

from __future__ import annotations

import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.ledger.store import Ledger
from p2p.identity import Identity
from tests.support import moeswarm, until
from tests.unit.test_ledger import make_receipt

ROOT = Path(__file__).resolve().parents[2]
ACKED = 50


def ack_child(path: str, n: int) -> None:
    """Commit *n* receipts one by one, print "acked" and wait to be killed (run in a child process)."""
    backbone = Identity.load_or_create(Path(path).parent / "backbone.pem")
    worker = Identity.generate()
    with Ledger(path, "backbone", backbone) as led:
        for i in range(n):
            led.append_receipt(*make_receipt(worker, backbone, i))
        print("acked", flush=True)
        time.sleep(600)


def sink_child(path: str, n: int) -> None:
    """Hand *n* receipts to a LedgerSink, print "sent" and wait to be killed (its writer process lives on)."""
    from node.ledger.sink import LedgerSink
    from node.logs import configure_logging

    configure_logging("warning")  # stdout carries only "sent"
    backbone = Identity.load_or_create(Path(path).parent / "backbone.pem")
    worker = Identity.generate()
    receipts = [make_receipt(worker, backbone, i) for i in range(n)]
    sink = LedgerSink(path, "backbone", backbone)
    for r, stamp in receipts:
        sink.receipt(r, stamp)
    print("sent", sink._proc.pid, flush=True)
    time.sleep(600)


def run_child(call: str, until_line: str) -> tuple[subprocess.Popen, list[str]]:
    """Start a child running *call*; return it once it printed *until_line* (and that line's words)."""
    child = subprocess.Popen([sys.executable, "-c", f"from tests.integration.test_ledger_loss import *; {call}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().split()
    if line[:1] != [until_line]:
        kill(child)
        raise AssertionError(f"the child printed {line!r}, not {until_line!r}")
    return child, line


def alive(pid: int) -> bool:
    """Whether *pid* still runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.stdout is not None
    child.stdout.close()


def count(path: Path) -> int:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    finally:
        con.close()


@pytest.fixture
def killed(tmp_path) -> Path:
    """A ledger whose 50 acknowledged commits are only in its WAL when its writer is SIGKILLed."""
    path = tmp_path / "ledger.sqlite"
    Ledger(path, "backbone", Identity.load_or_create(tmp_path / "backbone.pem")).close()  # schema checkpointed into the file
    assert not Path(f"{path}-wal").exists()
    kill(run_child(f"ack_child({str(path)!r}, {ACKED})", "acked")[0])
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 32 * 1024 and count(path) == ACKED  # every commit is there, in the WAL only
    return path


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def damage(wal: Path, how: str) -> None:
    size = wal.stat().st_size
    if how == "byte_mid_file":
        flip(wal, size // 2)
    elif how == "first_frame":
        flip(wal, 32 + 24 + 100)  # the WAL header is 32 bytes, each frame's header 24: inside frame 1's page
    elif how == "random":
        wal.write_bytes(random.Random(7).randbytes(size))
    elif how == "deleted":
        wal.unlink()
    elif how == "truncated_half":
        os.truncate(wal, size // 2)


@pytest.mark.parametrize("how", ["byte_mid_file", "first_frame", "random", "deleted", "truncated_half"])
def test_verify_names_the_acknowledged_entries_a_damaged_wal_lost(killed, how):
    """Each kind of WAL damage after a SIGKILL leaves a shorter chain that checks out by itself; `ledger verify`
    exits 1 naming exactly how many acknowledged entries are gone."""
    damage(Path(f"{killed}-wal"), how)
    left = count(killed)
    assert left < ACKED
    if how in ("first_frame", "random", "deleted"):
        assert left == 0
    out = moeswarm("ledger", "verify", "--ledger", str(killed), cwd=ROOT, timeout=60)
    assert out.returncode == 1, out
    assert out.stdout.startswith(f"lost {ACKED - left} acknowledged entries: entries {left + 1}-{ACKED} are gone"), out.stdout
    assert "head record" in out.stdout and "Traceback" not in out.stderr


def test_a_writer_reopening_a_damaged_ledger_keeps_the_intact_prefix_and_says_what_it_dropped(killed):
    """Opening for appends after a lost WAL half: the intact entries stay, the loss is logged and kept as evidence
    that `verify` names (exit 0 now: the record moved to the real end), and the chain goes on from there."""
    damage(Path(f"{killed}-wal"), "truncated_half")
    left = count(killed)
    backbone = Identity.load_or_create(killed.parent / "backbone.pem")
    with Ledger(killed, "backbone", backbone) as led:
        assert led.recovered is not None and led.recovered.missing == ACKED - left and led.recovered.held.seq == ACKED
        entry = led.append_receipt(*make_receipt(Identity.generate(), backbone, 1000))
    assert entry.seq == left + 1
    out = moeswarm("ledger", "verify", "--ledger", str(killed), cwd=ROOT, timeout=60)
    assert out.returncode == 0, out
    assert out.stdout.startswith(f"ok: {left + 1} entries") and f"from the loss of {ACKED - left} acknowledged entries (entries {left + 1}-{ACKED})" in out.stdout
    with Ledger(killed, "backbone", backbone) as led:
        assert led.recovered is None  # recovered once: a second opening finds record and chain agreeing


def test_a_ledger_rolled_back_to_its_owners_older_copy_fails_verify_alone(tmp_path):
    """800 entries acknowledged, then the file replaced by the owner's copy taken at 550: `verify` alone (no
    counterparty's ledger) exits 1 naming the 250 lost entries; the copy elsewhere, without a record, still verifies."""
    path, copy = tmp_path / "ledger.sqlite", tmp_path / "backup" / "ledger.sqlite"
    copy.parent.mkdir()
    backbone, worker = Identity.generate(), Identity.generate()
    with Ledger(path, "backbone", backbone) as led:
        for start in range(0, 800, 50):
            if start == 550:
                with sqlite3.connect(path) as live, sqlite3.connect(copy) as old:
                    live.backup(old)
            led.append_batch([led.receipt_event(*make_receipt(worker, backbone, i)) for i in range(start, start + 50)])
    assert moeswarm("ledger", "verify", "--ledger", str(path), cwd=ROOT, timeout=60).stdout.startswith("ok: 800 entries")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.write_bytes(copy.read_bytes())
    out = moeswarm("ledger", "verify", "--ledger", str(path), cwd=ROOT, timeout=60)
    assert out.returncode == 1 and out.stdout.startswith("lost 250 acknowledged entries: entries 551-800 are gone"), out
    elsewhere = moeswarm("ledger", "verify", "--ledger", str(copy), cwd=ROOT, timeout=60)
    assert elsewhere.returncode == 0 and "no head record" in elsewhere.stdout, elsewhere


@pytest.mark.slow
def test_an_undamaged_ledger_verifies_after_60_sigkills(tmp_path):
    """60 writers in a row, each SIGKILLed after a few acknowledged commits: every acknowledged entry is kept and
    the ledger, its signed head and its head record agree each time."""
    path = tmp_path / "ledger.sqlite"
    acked: set[tuple[str, str]] = set()
    for round_ in range(60):
        code = f"from tests.integration.test_ledger_cli import crash_child; crash_child({str(path)!r})"
        child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        for _ in range(1 + round_ % 4):
            line = child.stdout.readline()
            assert line, f"writer {round_} died before acknowledging"
            acked.add(tuple(line.split()))
        os.kill(child.pid, signal.SIGKILL)
        acked |= {tuple(line.split()) for line in child.stdout}
        child.wait()
        child.stdout.close()
        with Ledger(path) as led:
            report = led.verify()
            assert report.ok and not report.notes, report
            assert acked <= {(str(e.seq), e.event.ref.dispatch_id) for e in led.entries()}
    out = moeswarm("ledger", "verify", "--ledger", str(path), cwd=ROOT, timeout=60)
    assert out.returncode == 0 and re.match(r"ok: \d+ entries", out.stdout), out


def test_receipts_handed_to_a_sink_survive_a_sigkill_of_the_node(tmp_path):
    """The node (the sink's process) is SIGKILLed right after handing over 200 receipts: its writer process commits
    every one of them before it exits, and the ledger verifies."""
    path = tmp_path / "ledger.sqlite"
    node, (_, writer_pid) = run_child(f"sink_child({str(path)!r}, 200)", "sent")
    writer = int(writer_pid)
    kill(node)
    until(lambda: not alive(writer), timeout=60, interval=0.2, what="the writer committing and exiting")
    with Ledger(path) as led:
        assert led.verify().ok and len(led) == 200


def test_a_sink_counts_what_its_writer_refused_and_logs_it_as_the_nodes_own(tmp_path):
    """A replayed receipt handed to a sink: the writer process refuses it, the node's log has ledger.append_failed
    (forwarded from the writer) and the sink counts 3 acknowledged, 1 failed; the ledger verifies with 3 entries."""
    from structlog.testing import capture_logs

    from node.ledger.sink import LedgerSink

    backbone, worker = Identity.generate(), Identity.generate()
    path = tmp_path / "ledger.sqlite"
    with capture_logs() as logs:
        sink = LedgerSink(path, "backbone", backbone)
        for i in (0, 1, 2, 1):
            sink.receipt(*make_receipt(worker, backbone, i))
        sink.close()
    assert (sink.acknowledged, sink.failed) == (3, 1)
    events = [e["event"] for e in logs]
    assert "ledger.created" in events and events.count("ledger.append_failed") == 1, logs
    with Ledger(path) as led:
        assert led.verify().ok and len(led) == 3


def test_a_sink_whose_writer_died_counts_every_receipt_lost_in_one_log_line(tmp_path):
    """The writer process SIGKILLed under a running node: the node keeps going, each later receipt counts as failed
    and the log says so once (not once per receipt); close() still returns."""
    from structlog.testing import capture_logs

    from node.ledger.sink import LedgerSink

    backbone, worker = Identity.generate(), Identity.generate()
    sink = LedgerSink(tmp_path / "ledger.sqlite", "backbone", backbone)
    os.kill(sink._proc.pid, signal.SIGKILL)
    sink._proc.wait()
    with capture_logs() as logs:
        for i in range(5):
            sink.receipt(*make_receipt(worker, backbone, i))
        sink.close()
    assert sink.failed == 5 and [e["event"] for e in logs].count("ledger.writer_gone") == 1, logs
