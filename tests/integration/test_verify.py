"""`moeswarm verify`: one JSON object with the gate's numbers; verdicts are stored and enforced."""

from __future__ import annotations

import json
import os

import pytest

from experts.codecs import Codec
from experts.errors import CodecError
from node.verdicts import require_verified
from tests.support import moeswarm

from ..conftest import make_model

KEYS = {"model_digest", "wire", "remote_vs_local", "reference", "verdict"}
RVL = {"max_abs_diff", "min_cosine", "argmax_agree", "positions", "bit_identical"}


def verify(*args: str, env_home) -> tuple[int, dict]:
    env = {**os.environ, "MOESWARM_HOME": str(env_home)}
    p = moeswarm("verify", *args, "--json", timeout=300, env=env)
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, p.stdout + p.stderr
    return p.returncode, json.loads(lines[0])


def test_f32_is_bit_identical_and_lossy_codecs_are_gated(model_dir, tmp_path, monkeypatch):
    """f32 passes bit-identically; int8 is refused before its gate ran and accepted after it passed."""
    home = tmp_path / "home"
    monkeypatch.setenv("MOESWARM_HOME", str(home))
    path = make_model(model_dir, "qwen2moe", n_expert=16, n_expert_used=4, n_layer=3)
    rc, out = verify(str(path), "--wire", "f32", env_home=home)
    assert rc == 0 and KEYS <= out.keys() and RVL <= out["remote_vs_local"].keys()
    assert out["remote_vs_local"]["bit_identical"] is True
    assert out["remote_vs_local"]["max_abs_diff"] == 0.0
    assert out["reference"] is None and out["verdict"] == "pass" and out["wire"] == "f32"
    assert out["grouped_vs_ungrouped_max_abs_diff"] > 0.0  # top-4 over 3 groups: the order matters
    with pytest.raises(CodecError, match="not verified"):
        require_verified(out["model_digest"], Codec.INT8)
    rc, out8 = verify(str(path), "--wire", "int8", env_home=home)
    assert rc == 0 and out8["verdict"] == "pass" and out8["remote_vs_local"]["bit_identical"] is False
    assert out8["remote_vs_local"]["min_cosine"] >= 0.999
    require_verified(out["model_digest"], Codec.INT8)
    require_verified(out["model_digest"], Codec.F32)


@pytest.mark.llama
def test_reference_llamacpp_in_the_json(model_dir, tmp_path):
    """--reference llamacpp fills the reference block and passes on F32 weights."""
    pytest.importorskip("llama_cpp")
    path = make_model(model_dir, "qwen3moe", n_expert=16, n_expert_used=4, n_layer=3)
    rc, out = verify(str(path), "--reference", "llamacpp", env_home=tmp_path)
    ref = out["reference"]
    assert rc == 0 and ref["engine"] == "llamacpp"
    assert ref["min_cosine"] >= 0.99999 and ref["argmax_agree"] == 1.0
    assert ref["positions"] == out["remote_vs_local"]["positions"]
    assert {"near_ties_excluded", "route_ties_excluded"} <= ref.keys()


def test_default_wire_is_f16_only_after_its_gate_passed(model_dir, tmp_path, monkeypatch):
    """`--wire auto` means f32 until `moeswarm verify --wire f16` passed for the model, then f16."""
    from node.verdicts import default_wire

    monkeypatch.setenv("MOESWARM_HOME", str(tmp_path))
    path = make_model(model_dir, "qwen3moe", n_expert=16, n_expert_used=4)
    from experts.gguf_model import GGUFModel

    digest = GGUFModel(path).digest
    assert default_wire(digest) is Codec.F32
    rc, _ = verify(str(path), "--wire", "f16", env_home=tmp_path)
    assert rc == 0 and default_wire(digest) is Codec.F16
