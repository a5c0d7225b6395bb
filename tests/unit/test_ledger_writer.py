"""The ledger writer process (node/ledger/writer.py) exits cleanly however its pipe is closed."""

from __future__ import annotations

import subprocess
import sys
import time

from node.ledger.writer import receive, send
from p2p.identity import Identity


def test_stop_with_the_pipe_still_open_exits_cleanly(tmp_path):
    """The node sends "stop" and closes the pipe a moment later (LedgerSink.close): the writer, done committing, must
    not leave the interpreter while its pipe-reader thread is blocked reading. It did: "Fatal Python error:
    _enter_buffered_busy: could not acquire lock for <stdin> at interpreter shutdown", an abort at every node's exit."""
    proc = subprocess.Popen([sys.executable, "-m", "node.ledger.writer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        send(proc.stdin.fileno(), ("open", str(tmp_path / "ledger.sqlite"), "worker", Identity.generate().seed))
        replies = []
        while (reply := receive(proc.stdout)) is not None and reply[0] != "ready":
            replies.append(reply)
        assert reply == ("ready",), replies
        send(proc.stdin.fileno(), ("stop",))
        time.sleep(1.0)  # the writer has committed and returned from its loop by now; its reader still waits on the pipe
        proc.stdin.close()
        assert proc.wait(30) == 0
        stderr = proc.stderr.read().decode(errors="replace")
        assert "Fatal Python error" not in stderr, stderr
    finally:
        proc.kill()
        proc.wait()
