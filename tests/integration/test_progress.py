"""Progress bars on real commands (on a terminal only), and Ctrl-C while a worker loads."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios

import gguf
import pytest

from tests.support import MOESWARM, moeswarm

from ..conftest import make_model

pytestmark = pytest.mark.slow
ESCAPES = ("\r", "\x1b[")


def test_slice_draws_bars_on_a_terminal_and_none_when_piped(tmp_path, model_dir):
    """`moeswarm slice` with stderr on a pseudo-terminal draws bars (carriage returns); piped, its output has
    no carriage return and no escape code."""
    model = make_model(model_dir, "qwen3moe", n_expert=16)
    piped = moeswarm("slice", str(model), "--layers", "0-1", "--experts", "0-7", "-o", str(tmp_path / "piped.gguf"))
    assert piped.returncode == 0, piped.stderr
    assert not any(e in piped.stdout + piped.stderr for e in ESCAPES), repr(piped.stderr)

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a new pty is 0 columns wide
    try:
        proc = subprocess.Popen([*MOESWARM, "slice", str(model), "--layers", "0-1", "--experts", "0-7", "-o", str(tmp_path / "tty.gguf")], stdout=subprocess.PIPE, stderr=follower, text=True)
        os.close(follower)
        out, _ = proc.communicate(timeout=120)
        drawn = b""
        while select.select([leader], [], [], 5)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
    assert proc.returncode == 0 and out.startswith("wrote ")
    assert b"\r" in drawn and b"checking the slice" in drawn, drawn[-500:]


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Many small experts: the reference kernel's cached load dequantizes each one (several seconds in all)."""
    return make_model(tmp_path_factory.mktemp("slow"), "qwen3moe", qtype=gguf.GGMLQuantizationType.Q4_0, n_expert=512, n_layer=16, n_embd=64, n_ff_exp=32)


def test_ctrl_c_while_loading_stops_at_once_with_one_line(tmp_path, slow_model):
    """SIGINT while the worker loads its experts ends it before the load finished (the loading thread stops at its
    next step instead of running to the end): exit 130, one line of its own on stderr, no traceback."""
    proc = subprocess.Popen([*MOESWARM, "--log-level", "info", "worker", "--model", str(slow_model), "--kernel", "reference", "--data-dir", str(tmp_path / "w")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # bounded: the process exits (and the stream ends) if loading fails
            seen.append(line)
            if "worker.load_phase" in line and "loading experts" in line:
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    stopped = re.search(r"worker.load_cancelled +done=(\d+) phase='loading experts' total=(\d+|None)", rest)
    assert stopped, rest  # total None: cancelled before the loading thread took its first step
    assert stopped[2] == "None" and stopped[1] == "0" or int(stopped[1]) < int(stopped[2]), rest
    mine = [line for line in rest.splitlines() if "[info" not in line]
    assert mine == ["worker stopped: interrupted"], rest
    assert "Traceback" not in rest and "worker.ready" not in "".join(seen) + rest
