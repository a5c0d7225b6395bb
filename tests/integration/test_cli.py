"""The `moeswarm` command on bad input: one clear line on stderr, non-zero exit, never a traceback."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from p2p.identity import Identity
from tests.support import MOESWARM, moeswarm

from ..conftest import make_model

run = moeswarm


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0]


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    good = make_model(model_dir, "qwen2moe")
    other = make_model(model_dir, "qwen2moe", seed=3)
    truncated = d / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-777])
    wrong_arch = d / "wrong.gguf"
    import gguf

    w = gguf.GGUFWriter(str(wrong_arch), "rwkv6")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    sl = d / "slice.gguf"
    assert run("slice", str(other), "--layers", "0-1", "--experts", "0-3", "-o", str(sl)).returncode == 0
    return {"good": good, "truncated": truncated, "wrong_arch": wrong_arch, "other_slice": sl}


def test_truncated_gguf(files):
    """A truncated file is named as truncated."""
    assert_one_line_error(run("inspect", str(files["truncated"])), "truncated")


def test_wrong_arch(files):
    """An unsupported architecture is named, with the supported list."""
    assert_one_line_error(run("verify", str(files["wrong_arch"])), "rwkv6", "qwen2moe")


def test_expert_range_out_of_bounds(files, tmp_path):
    """Asking for experts the model does not have says which exist."""
    p = run("slice", str(files["good"]), "--layers", "0-1", "--experts", "4-12", "-o", str(tmp_path / "s.gguf"))
    assert_one_line_error(p, "4-12", "0-7")
    assert not (tmp_path / "s.gguf").exists()


def test_slice_of_a_different_model(files):
    """A slice checked against a model it was not cut from is refused, naming both digests."""
    assert_one_line_error(run("inspect", str(files["other_slice"]), "--against", str(files["good"])), "was cut from model")


def test_missing_file():
    """A path that does not exist is reported as such."""
    assert_one_line_error(run("inspect", "/nonexistent/model.gguf"), "does not exist")


def test_bad_listen_address():
    """An address that is not HOST:PORT is named, with the form it should take."""
    assert_one_line_error(run("relay", "--listen", "nonsense"), "'nonsense'", "HOST:PORT")


def test_key_file_readable_by_others(tmp_path):
    """A key file other users can read is refused with the command that fixes it."""
    key = tmp_path / "relay" / "key.pem"
    key.parent.mkdir()
    key.write_text("not a key")
    key.chmod(0o644)
    assert_one_line_error(run("relay", "--data-dir", str(key.parent)), "chmod 600")


def test_bootstrap_prints_the_multiaddr_to_hand_out(tmp_path):
    """At the default log level `moeswarm bootstrap` prints one stdout line with its /p2p/ multiaddr, and only that."""
    proc = subprocess.Popen([*MOESWARM, "bootstrap", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    peer = Identity.load_or_create(tmp_path / "key.pem").peer_id
    assert re.fullmatch(rf"bootstrap serving; join with: --bootstrap /ip4/127\.0\.0\.1/tcp/\d+/p2p/{peer}\n", line), line
    assert rest == ""
