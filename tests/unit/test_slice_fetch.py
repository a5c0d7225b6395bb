"""The sans-IO slice fetch: the digest as the only trust root, the plan's holder choice and drops, and a written
slice identical to `moeswarm slice`'s."""

from __future__ import annotations

import pytest

from experts.embedded import EMBEDDED_MODEL
from experts.errors import SliceError
from experts.gguf_model import ExpertRange, GGUFModel
from experts.parts import TOKENIZER_ITEM, Part, part_names
from experts.slice_fetch import FetchPlan, Holder, OutsideModel, SliceLayout, Staging
from experts.slices import check_slice, write_part_slice, write_slice

MODEL = GGUFModel(EMBEDDED_MODEL)
LAYERS, EXPERTS = range(1, 3), ExpertRange(2, 6)


def layout() -> SliceLayout:
    lay = SliceLayout.from_manifest(MODEL.digest, MODEL.manifest, LAYERS, EXPERTS)
    for name in lay.names:
        assert lay.accept_leaves(name, MODEL.leaves[name])
    return lay


def test_a_manifest_of_another_model_is_refused():
    forged = [MODEL.manifest[0].replace('"n_expert_used": 4', '"n_expert_used": 3'), *MODEL.manifest[1:]]
    assert forged != MODEL.manifest
    with pytest.raises(SliceError, match="does not hash to model"):
        SliceLayout.from_manifest(MODEL.digest, forged, LAYERS, EXPERTS)


def test_a_range_outside_the_model_is_the_requests_fault():
    with pytest.raises(OutsideModel, match="out of bounds"):
        SliceLayout.from_manifest(MODEL.digest, MODEL.manifest, range(0, 9), EXPERTS)


def test_forged_leaves_are_refused():
    lay = SliceLayout.from_manifest(MODEL.digest, MODEL.manifest, LAYERS, EXPERTS)
    name = lay.names[0]
    forged = ["0" * 64, *MODEL.leaves[name][1:]]
    assert not lay.accept_leaves(name, forged)
    assert not lay.accept_leaves("blk.0.ffn_up_exps.weight", MODEL.leaves["blk.0.ffn_up_exps.weight"])  # not in the slice
    assert name in lay.missing_leaves
    with pytest.raises(SliceError, match="no holder gave valid leaves"):
        lay.items()


def test_a_bad_piece_drops_its_holder_and_goes_to_another():
    items = layout().items()
    plan = FetchPlan(items)
    plan.add_holder(Holder("liar", range(0, 4), range(0, 32)))
    plan.add_holder(Holder("honest", range(1, 2), range(0, 32)))
    first = plan.take("liar")
    assert first is not None and plan.take("honest") != first  # never the same expert to two holders at once
    assert not plan.received("liar", first, b"\0" * first.nbytes)
    assert "liar" in plan.dropped and plan.take("liar") is None
    assert plan.stuck() is not None  # layer 2 had only the liar
    again = plan.take("honest")
    assert again is not None


def test_strikes_drop_a_holder_that_keeps_failing():
    items = layout().items()
    plan = FetchPlan(items)
    plan.add_holder(Holder("slow", range(0, 4), range(0, 32)))
    for _ in range(3):
        item = plan.take("slow")
        assert item is not None
        plan.failed("slow", item, "timeout")
    assert "slow" in plan.dropped and not plan.could_serve("slow")


def test_staged_and_written_slice_equals_the_cut(tmp_path):
    """Every expert verified and staged, then written: byte for byte `moeswarm slice`; a restart re-uses the stage."""
    lay = layout()
    items = lay.items()
    staging = Staging(tmp_path / "s.gguf.parts")
    plan = FetchPlan(items)
    plan.add_holder(Holder("h", range(0, 4), range(0, 32)))
    while (item := plan.take("h")) is not None:
        data = MODEL.expert_rows(item.name, item.expert).tobytes()
        assert plan.received("h", item, data)
        staging.write(item, data)
    assert plan.finished and plan.fetched_bytes == plan.total_bytes
    out = lay.write(tmp_path / "s.gguf", staging)
    cut = write_slice(MODEL, LAYERS, EXPERTS, tmp_path / "cut.gguf")
    assert out.read_bytes() == cut.read_bytes()
    staging.path(items[0].leaf).write_bytes(b"torn")
    assert staging.verified(items) == set(items[1:])  # the torn file is not trusted, the rest is kept


def test_two_lanes_staging_items_with_equal_bytes_at_once_both_succeed(tmp_path):
    """Files are named by content: two items with the same bytes (two equal norms) are one file, and two lanes may
    write it at the same moment. With one shared temporary name the second rename found no file (CI, 2026-12-07)."""
    from concurrent.futures import ThreadPoolExecutor

    item = layout().items()[0]
    data = MODEL.expert_rows(item.name, item.expert).tobytes()
    staging = Staging(tmp_path / "s.gguf.parts")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: staging.write(item, data), range(400)))
    assert staging.verified([item]) == {item} and [p.name for p in staging.dir.iterdir()] == [staging.path(item.leaf).name]


def test_the_whole_model_from_its_manifest_sizes_experts_as_the_file_does(model_dir):
    """`join --fetch` has only the digest: a verified manifest gives the model's layers, experts and each expert's
    bytes (here quantized: block-aligned rows), as the file would; a manifest of another digest gives nothing."""
    from gguf import GGMLQuantizationType as Q

    from experts.hosting import packed_bytes
    from tests.conftest import make_model

    m = GGUFModel(make_model(model_dir, "qwen3moe", Q.Q8_0, n_layer=2))
    whole = SliceLayout.whole(m.digest, m.manifest)
    assert whole.layers == range(m.cfg.n_layer) and whole.experts == ExpertRange(0, m.cfg.n_expert)
    for layer in m.moe_layers:
        assert whole.expert_nbytes(layer) == packed_bytes(m, range(layer, layer + 1), ExpertRange(0, 1)) > 0
    with pytest.raises(SliceError, match="does not hash to model"):
        SliceLayout.whole(MODEL.digest, m.manifest)


def whole_bytes(item) -> bytes:
    """What an honest full-model holder sends for a whole piece (a tensor, or the tokenizer blob)."""
    return MODEL.tokenizer_blob if item.name == TOKENIZER_ITEM else MODEL.raw(item.name).tobytes()


@pytest.mark.parametrize(("part", "layers"), [(Part.DENSE, range(1, 3)), (Part.HEAD, range(0))])
def test_a_fetched_dense_or_head_slice_equals_the_cut(tmp_path, part, layers):
    """Whole tensors (and the head's tokenizer blob) planned from the manifest alone, each checked against its line,
    then written: byte for byte `moeswarm slice --dense/--head`; a holder's forged hash is not taken as an offer."""
    lay = SliceLayout.from_manifest(MODEL.digest, MODEL.manifest, layers, None, part)
    items = lay.items()
    assert {i.name for i in items} == set(part_names(part, MODEL.tensors, layers)) | ({TOKENIZER_ITEM} if part is Part.HEAD else set())
    assert all(i.whole and i.expert == 0 for i in items) and not lay.missing_leaves
    name = items[0].name
    assert lay.accept_leaves(name, [items[0].leaf]) and not lay.accept_leaves(name, ["0" * 64])
    assert not lay.accept_leaves("blk.0.ffn_up_exps.weight", MODEL.leaves["blk.0.ffn_up_exps.weight"])  # not a whole tensor of it
    plan = FetchPlan(items)
    plan.add_holder(Holder("liar", range(0, 4), range(0, 32), whole=frozenset(i.name for i in items)))
    plan.add_holder(Holder("experts-only", range(0, 4), range(0, 32)))  # an expert slice's holder: none of these
    first = plan.take("liar")
    assert first is not None and plan.take("experts-only") is None
    assert not plan.received("liar", first, b"\0" * first.nbytes) and "liar" in plan.dropped
    assert plan.stuck() is not None
    plan.add_holder(Holder("h", range(0, 4), range(0, 32), whole=frozenset(i.name for i in items)))
    staging = Staging(tmp_path / "s.gguf.parts")
    while (item := plan.take("h")) is not None:
        data = whole_bytes(item)
        assert plan.received("h", item, data)
        staging.write(item, data)
    assert plan.finished
    out = lay.write(tmp_path / "s.gguf", staging)
    cut = write_part_slice(MODEL, part, layers, tmp_path / "cut.gguf")
    assert out.read_bytes() == cut.read_bytes()
    check_slice(GGUFModel(out), MODEL.digest)


def test_a_dense_range_outside_the_trunk_is_the_requests_fault():
    with pytest.raises(OutsideModel, match="out of bounds"):
        SliceLayout.from_manifest(MODEL.digest, MODEL.manifest, range(2, 40), None, Part.DENSE)
