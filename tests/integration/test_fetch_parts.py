"""`moeswarm slice/fetch --dense/--head` on real processes: dense and head slices come from workers holding the full
model over loopback, equal `moeswarm slice`'s byte for byte, a corrupting holder is caught, and the pieces fetched
(head, dense weights of every layer, experts) run the full model's backbone bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import GGUFModel
from experts.model_parts import SlicedModel
from experts.moe import ungrouped_moe
from experts.slices import ExpertStore, check_slice
from node.launcher import Cluster
from tests.support import moeswarm

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])
MODEL = GGUFModel(EMBEDDED_MODEL)
LAST = MODEL.cfg.n_layer - 1


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap and two workers of the full model, hosting different layers (a full file serves every whole tensor)."""
    with Cluster(tmp_path_factory.mktemp("fetch-parts")) as cluster:
        boot = cluster.start("bootstrap", "bootstrap", "--listen", "127.0.0.1:0").wait_ready()["dht_addrs"][0]
        holders = [cluster.start(f"w{i}", "worker", "--model", str(MODEL.path), "--layers", layers, "--bootstrap", boot) for i, layers in enumerate(("0-1", f"2-{LAST}"))]
        ready = [h.wait_ready(timeout=120) for h in holders]
        yield cluster, boot, ready


@pytest.fixture(scope="module")
def cuts(tmp_path_factory) -> dict[str, Path]:
    """`moeswarm slice --head` and `--dense 0-LAST` of the model, through the CLI."""
    d = tmp_path_factory.mktemp("cuts")
    out = {"head": d / "head.gguf", "dense": d / "dense.gguf"}
    for args in (["--head"], ["--dense", "--layers", f"0-{LAST}"]):
        which = "head" if args == ["--head"] else "dense"
        r = moeswarm("slice", str(MODEL.path), *args, "-o", str(out[which]))
        assert r.returncode == 0, r.stderr
        assert ("the head" if which == "head" else "dense weights of layers") in r.stdout and MODEL.digest[:16] in r.stdout
    return out


def fetch(boot: str, out: Path, *part: str) -> dict:
    r = moeswarm("fetch", "--model-digest", MODEL.digest, *part, "-o", str(out), "--bootstrap", boot, "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"stderr": r.stderr}


def test_head_and_dense_slices_from_two_holders_are_the_cuts_and_run_the_model(tmp_path, swarm, cuts):
    """Both holders contribute; each file is the CLI's cut byte for byte; with the experts of the full file they
    compute its logits exactly."""
    _, boot, _ = swarm
    head, dense = tmp_path / "head.gguf", tmp_path / "dense.gguf"
    got_head = fetch(boot, head, "--head")
    got_dense = fetch(boot, dense, "--dense", f"0-{LAST}")
    assert head.read_bytes() == cuts["head"].read_bytes()
    assert dense.read_bytes() == cuts["dense"].read_bytes()
    assert len(got_dense["by_holder"]) == 2 and not got_dense["dropped"] and got_dense["fetched_bytes"] == got_dense["total_bytes"]
    assert got_head["fetched_bytes"] == got_head["total_bytes"] > MODEL.tensors["token_embd.weight"].n_bytes
    parts = SlicedModel([GGUFModel(head), GGUFModel(dense)], MODEL.digest)
    store = ExpertStore(MODEL)
    hook = local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))
    want = Backbone(MODEL).forward([1, 5, 7], KVCache(), hook)
    assert Backbone(parts).forward([1, 5, 7], KVCache(), hook).tobytes() == want.tobytes()


def test_a_corrupting_holder_of_whole_tensors_is_dropped(tmp_path, swarm, cuts):
    """A full-model holder that flips a byte of every piece: dropped on its first tensor, the slice still exact."""
    cluster, boot, _ = swarm
    bad = cluster.start("corrupt", "worker", "--model", str(MODEL.path), "--layers", "0-1", "--bootstrap", boot, module="tests.doubles.corrupt_slice_worker", env={"PYTHONPATH": REPO})
    peer = bad.wait_ready(timeout=120)["peer_id"]
    try:
        out = tmp_path / "dense.gguf"
        result = fetch(boot, out, "--dense", "1-2")
        check_slice(GGUFModel(out), MODEL.digest)
        assert list(result["dropped"]) == [peer] and "do not match the model's leaf" in result["dropped"][peer]
        assert peer not in result["by_holder"]
    finally:
        bad.stop()


def test_wrong_fetch_options_are_one_error_line(tmp_path, swarm):
    """--head with --layers, or a dense range past the model, exit 2 with one line and write nothing."""
    _, boot, _ = swarm
    for args, says in ((["--head", "--layers", "0-1"], "--head takes neither"), (["--dense", "0-40"], "out of bounds")):
        r = moeswarm("fetch", "--model-digest", MODEL.digest, *args, "-o", str(tmp_path / "x.gguf"), "--bootstrap", boot, timeout=120)
        assert r.returncode == 2, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and says in errors[0], r.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_inspect_names_a_dense_or_head_slice_and_refuses_a_tampered_one(tmp_path, cuts):
    """`inspect --against` proves the slice and says what part it is; one flipped tensor byte is one error line."""
    r = moeswarm("inspect", str(cuts["head"]), "--against", str(MODEL.path))
    assert r.returncode == 0 and "head slice of model" in r.stdout and MODEL.digest in r.stdout, r.stderr
    dense = GGUFModel(cuts["dense"])
    t = dense.tensors["blk.2.attn_q.weight"]
    data = bytearray(cuts["dense"].read_bytes())
    data[int(t.data_offset) + 5] ^= 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    r = moeswarm("inspect", str(bad))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and "tensor blk.2.attn_q.weight does not match" in errors[0], r.stderr
