"""What a worker prints, as a real process, over a run where another peer leaves: few lines at the default level,
none of them libp2p's; JSON lines only with --log-json (libp2p's records, shown at debug, included)."""

from __future__ import annotations

import json

import pytest

from experts.embedded import EMBEDDED_MODEL
from node.launcher import Cluster
from tests.support import moeswarm, wait_for_log

pytestmark = pytest.mark.slow


def test_a_peer_leaving_adds_no_libp2p_lines_and_json_stays_json(tmp_path):
    """Three workers share the experts (only the quiet one hosts 0-15, so it serves every layer); after a generation through them one is killed. A watcher at
    ``--log-level debug --log-json`` logs libp2p's complaints about the dead peer (every one of its lines is a JSON
    object); the worker at the default level meanwhile printed fewer than 20 lines, none from libp2p, among them its
    loading, ready and per-interval summary lines."""
    model = str(EMBEDDED_MODEL)
    with Cluster(tmp_path) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        common = ["worker", "--model", model, "--bootstrap", boot]
        quiet = cluster.start("quiet", *common, "--experts", "0-15", "--summary-interval", "2")
        leaver = cluster.start("leaver", *common, "--experts", "16-31")
        watcher = cluster.start("watcher", "--log-level", "debug", "--log-json", *common, "--experts", "16-31")
        for node in (quiet, leaver, watcher):
            node.wait_ready()
        gone = leaver.wait_ready()["dht_addrs"][0].split("/")[4]  # /ip4/127.0.0.1/tcp/PORT/p2p/ID
        gen = moeswarm("backbone", "generate", "--model", model, "--bootstrap", boot, "And God said", "--tokens", "4", "--json", timeout=180)
        assert gen.returncode == 0, gen.stderr[-3000:]
        wait_for_log(quiet.log_file, "worker.summary", timeout=60)
        leaver.kill()
        # libp2p's redials of the dead peer fail with records at its error level (the flood that --log-level info hid)
        wait_for_log(watcher.log_file, '"logger": "libp2p.', '"level": "error"', f"127.0.0.1:{gone}", timeout=180)

    quiet_lines = quiet.log_file.read_text().splitlines()
    assert len(quiet_lines) < 20, "\n".join(quiet_lines)
    assert not [line for line in quiet_lines if "libp2p" in line], "\n".join(quiet_lines)
    assert [line for line in quiet_lines if "worker.loading" in line] and [line for line in quiet_lines if "worker.ready" in line]

    watcher_lines = watcher.log_file.read_text().splitlines()
    events = [json.loads(line) for line in watcher_lines]  # raises on any line that is not JSON
    assert all(isinstance(e, dict) and "event" in e and "level" in e for e in events)
    assert any(e.get("logger", "").startswith("libp2p.") for e in events) and any(e["event"] == "worker.ready" for e in events)
    assert not any("exc_info" in e for e in events)
