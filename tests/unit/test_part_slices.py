"""Dense and head slices: cut by the file's own tensor names, proven against the digest, refused when tampered, and
together with expert slices the whole file again (and the same backbone)."""

from __future__ import annotations

import gguf
import pytest

from experts.errors import ModelFormatError, SliceError
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import ExpertRange, GGUFModel, model_digest
from experts.model_parts import SlicedModel
from experts.moe import ungrouped_moe
from experts.parts import Part, TokenizerField, block_of, parse_manifest, tokenizer_fields, tokenizer_line
from experts.slices import ExpertStore, check_slice, write_part_file, write_part_slice, write_slice

from ..conftest import ARCHS, ISSUE15_ARCHS, NEW_ARCHS, make_model

Q = gguf.GGMLQuantizationType
# One arch per shape of dense part: shared experts (qwen2moe), QK norms, NORM RoPE, dense lead layers + MLA + MTP
# (deepseek2), expert biases + sinks (gpt-oss), interleaved MoE + rope_freqs (llama4), recurrent layers (qwen3next).
UNION_ARCHS = (*ARCHS, "gpt-oss", "llama4", "deepseek2", "qwen3next")
QTYPE = {"deepseek2": Q.F32}  # its 48-wide q_b rows do not fit Q8_0 blocks
assert set(UNION_ARCHS) <= set(ARCHS + NEW_ARCHS + ISSUE15_ARCHS)


def cut_all(full: GGUFModel, tmp_path) -> tuple[GGUFModel, list[GGUFModel], GGUFModel]:
    """The head, the dense weights in two ranges, and every expert: what a client, two stages and workers hold."""
    n = full.cfg.n_layer
    head = GGUFModel(write_part_slice(full, Part.HEAD, out=tmp_path / "head.gguf"))
    cut = max(1, n // 2)
    dense = [GGUFModel(write_part_slice(full, Part.DENSE, r, tmp_path / f"dense{r.start}.gguf")) for r in (range(0, cut), range(cut, n)) if r]
    experts = GGUFModel(write_slice(full, range(n), ExpertRange(0, full.cfg.n_expert), tmp_path / "experts.gguf"))
    return head, dense, experts


@pytest.mark.parametrize("arch", UNION_ARCHS)
def test_head_dense_and_expert_slices_are_the_whole_file_byte_for_byte(model_dir, tmp_path, arch):
    """Each slice verifies against the digest; their union is every tensor of the trunk, same type, shape, bytes."""
    full = GGUFModel(make_model(model_dir, arch, QTYPE.get(arch, Q.Q8_0), n_layer=4 if arch == "llama4" else 3))
    head, dense, experts = cut_all(full, tmp_path)
    for sl in (head, *dense, experts):
        check_slice(sl, full.digest)
        assert sl.digest == full.digest
    held: dict[str, GGUFModel] = {}
    for sl in (head, *dense, experts):
        for name in sl.tensors:
            assert name not in held or block_of(name) is None and sl in dense, f"{name} is in two slices"  # only model-wide tensors repeat
            held[name] = sl
    trunk = [n for n in full.tensors if (block_of(n) or 0) < full.cfg.n_layer]
    assert sorted(held) == sorted(trunk)  # MTP blocks (deepseek2's blk.3) belong to no slice yet
    for name in trunk:
        sl = held[name]
        assert sl.qtype(name) == full.qtype(name) and sl.shape(name) == full.shape(name)
        assert sl.raw(name).tobytes() == full.raw(name).tobytes(), name
    assert head.tokenizer_blob == full.tokenizer_blob and head.tokenizer_spec == full.tokenizer_spec
    assert set(head.tensors) <= {"token_embd.weight", "output_norm.weight", "output.weight"}
    if full.has("rope_freqs.weight"):  # model-wide, read by every layer's attention: in each dense slice, the same bytes
        assert all(d.raw("rope_freqs.weight").tobytes() == full.raw("rope_freqs.weight").tobytes() for d in dense)


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_a_backbone_from_head_and_dense_slices_computes_the_full_models_logits(model_dir, tmp_path, arch):
    """Backbone(SlicedModel) with experts from an expert slice gives the full file's logits bit for bit."""
    full = GGUFModel(make_model(model_dir, arch, QTYPE.get(arch, Q.Q8_0), n_layer=3))
    head, dense, experts = cut_all(full, tmp_path)
    parts = SlicedModel([head, *dense], full.digest)
    assert parts.layers == range(full.cfg.n_layer) and parts.has_head and not parts.is_slice
    assert parts.tokenizer_spec == full.tokenizer_spec
    tokens = [1, 5, 9, 2, 7]

    def hook(model: GGUFModel):
        store = ExpertStore(model)
        return local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w))

    want = Backbone(full).forward(tokens, KVCache(), hook(full))
    got = Backbone(parts).forward(tokens, KVCache(), hook(experts))
    assert got.tobytes() == want.tobytes()


def test_a_stage_and_a_clients_slices_cover_only_their_part(model_dir, tmp_path):
    """A stage's dense slice has its layers' tensors only; a client's head no layer; mixing models is refused."""
    full = GGUFModel(make_model(model_dir, "qwen3moe", n_layer=3))
    head, dense, _ = cut_all(full, tmp_path)
    stage = SlicedModel(dense[1:], full.digest)
    assert stage.layers == dense[1].layers and not stage.has_head
    assert all(block_of(n) in stage.layers for n in stage.tensors)
    assert stage.dense("blk.2.attn_q.weight").tobytes() == full.dense("blk.2.attn_q.weight").tobytes()
    client = SlicedModel([head], full.digest)
    assert client.layers == range(0) and client.has_head
    with pytest.raises(SliceError, match="hold no routed experts"):
        _ = stage.experts
    with pytest.raises(SliceError, match="holds no experts"):
        ExpertStore(dense[0])
    other = GGUFModel(make_model(model_dir, "qwen3moe", seed=3, n_layer=3))
    foreign = GGUFModel(write_part_slice(other, Part.DENSE, range(0, 1), tmp_path / "foreign.gguf"))
    with pytest.raises(SliceError, match="not from"):
        SlicedModel([head, foreign], full.digest)
    with pytest.raises(SliceError, match="an expert slice"):
        SlicedModel([GGUFModel(write_slice(full, range(0, 1), ExpertRange(0, 2), tmp_path / "e.gguf"))])


def flip(path, tmp_path, offset: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    bad = tmp_path / f"bad-{offset}.gguf"
    bad.write_bytes(bytes(data))
    return GGUFModel(bad)


def test_a_flipped_byte_in_a_dense_or_head_tensor_is_refused(model_dir, tmp_path):
    """One bit of one tensor, anywhere, names that tensor."""
    full = GGUFModel(make_model(model_dir, "qwen2moe", Q.Q4_K, n_embd=256, n_ff_exp=256, n_head=4, head_dim=64))
    head, dense, _ = cut_all(full, tmp_path)
    for sl, name in ((dense[0], "blk.0.attn_k.weight"), (dense[-1], "blk.1.ffn_gate_inp_shexp.weight"), (head, "token_embd.weight"), (head, "output_norm.weight")):
        t = sl.tensors[name]
        bad = flip(sl.path, tmp_path, int(t.data_offset) + int(t.n_bytes) // 2)
        with pytest.raises(SliceError, match=f"tensor {name} does not match"):
            check_slice(bad, full.digest)


def test_a_forged_manifest_a_swapped_tokenizer_and_a_missing_tensor_are_refused(model_dir, tmp_path):
    """The manifest must hash to the digest; the head's tokenizer keys and a slice's tensor set must be the model's."""
    full = GGUFModel(make_model(model_dir, "llama", n_layer=3))
    manifest = full.manifest
    lines = {line.split("|")[0]: line for line in manifest[2:]}
    parsed = parse_manifest(manifest).tensors
    names = [n for n in full.tensors if block_of(n) == 1 and not n.endswith("_exps.weight")]
    tensors = [(n, parsed[n], full.raw(n)) for n in names]
    # one hash of the stored manifest edited in place (to vouch for tampered bytes): the file still claims the digest
    ok = write_part_file(tmp_path / "ok-dense.gguf", full.cfg, manifest, Part.DENSE, range(1, 2), tensors, None)
    check_slice(GGUFModel(ok), full.digest)
    line = lines["blk.1.attn_q.weight"].encode()
    data = ok.read_bytes()
    assert data.count(line) == 1
    forged = tmp_path / "forged.gguf"
    forged.write_bytes(data.replace(line, line[:-64] + b"0" * 64))
    with pytest.raises(SliceError, match="does not hash to the model digest"):
        check_slice(GGUFModel(forged), full.digest)
    # a manifest forged whole names another digest: refused as another model's
    other = [f"{m}|x" if m.startswith("blk.1.attn_q.weight|") else m for m in manifest]
    with pytest.raises(SliceError, match="not from"):
        check_slice(GGUFModel(write_part_file(tmp_path / "other.gguf", full.cfg, other, Part.DENSE, range(1, 2), tensors, None)), full.digest)
    with pytest.raises(ModelFormatError, match=f"tensor {names[0]} is missing"):  # a required tensor: the file does not open
        GGUFModel(write_part_file(tmp_path / "short.gguf", full.cfg, manifest, Part.DENSE, range(1, 2), tensors[1:], None))
    l4 = GGUFModel(make_model(model_dir, "llama4", n_layer=2))  # an optional tensor the model has: the manifest wants it
    l4_lines = parse_manifest(l4.manifest).tensors
    assert l4.has("rope_freqs.weight")
    no_freqs = [(n, l4_lines[n], l4.raw(n)) for n in l4.tensors if block_of(n) == 0 and not n.endswith(("_exps.weight", "_exps.bias"))]
    with pytest.raises(SliceError, match="lacks tensor rope_freqs.weight"):
        check_slice(GGUFModel(write_part_file(tmp_path / "nofreqs.gguf", l4.cfg, l4.manifest, Part.DENSE, range(0, 1), no_freqs, None)), l4.digest)
    wide = write_part_file(tmp_path / "wide.gguf", full.cfg, manifest, Part.DENSE, range(1, 2), [*tensors, ("blk.0.attn_q.weight", parsed["blk.0.attn_q.weight"], full.raw("blk.0.attn_q.weight"))], None)
    with pytest.raises(ModelFormatError, match="blk.0.attn_q.weight in .* is not one moeswarm reads"):
        GGUFModel(wide)  # another layer's tensor: the file does not open
    fields = tokenizer_fields(full.reader)
    swapped = [TokenizerField(f.key, f.types, [*f.value[:5], f.value[6], f.value[5], *f.value[7:]]) if f.key == "tokenizer.ggml.tokens" else f for f in fields]
    head_names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    head = [(n, parsed[n], full.raw(n)) for n in head_names if full.has(n)]
    assert GGUFModel(write_part_file(tmp_path / "ok.gguf", full.cfg, manifest, Part.HEAD, range(0), head, fields)).tokenizer_blob == full.tokenizer_blob
    with pytest.raises(SliceError, match="tokenizer metadata is not"):
        check_slice(GGUFModel(write_part_file(tmp_path / "tok.gguf", full.cfg, manifest, Part.HEAD, range(0), head, swapped)), full.digest)


def test_the_digest_covers_the_tokenizer(model_dir, tmp_path):
    """Two files with the same tensors and hyper-parameters but another vocabulary have different digests."""
    full = GGUFModel(make_model(model_dir, "llama", n_layer=3))
    assert full.manifest[1].startswith(f"tokenizer|{len(full.tokenizer_blob)}|")
    fields = tokenizer_fields(full.reader)
    renamed = [TokenizerField(f.key, f.types, "other-pre") if f.key == "tokenizer.ggml.pre" else f for f in fields]
    assert renamed != fields
    head = [(n, line, full.raw(n)) for n, line in parse_manifest(full.manifest).tensors.items() if n in ("token_embd.weight", "output_norm.weight", "output.weight")]
    other = GGUFModel(write_part_file(tmp_path / "o.gguf", full.cfg, full.manifest, Part.HEAD, range(0), head, renamed))
    assert other.tokenizer_blob != full.tokenizer_blob
    assert model_digest([full.manifest[0], tokenizer_line(other.tokenizer_blob), *full.manifest[2:]]) != full.digest


def test_a_dense_range_outside_the_trunk_and_a_slice_of_a_slice_are_refused(model_dir, tmp_path):
    """Layers past the trunk, and cutting from a slice, are SliceErrors."""
    full = GGUFModel(make_model(model_dir, "qwen2moe", n_layer=3))
    with pytest.raises(SliceError, match="out of bounds"):
        write_part_slice(full, Part.DENSE, range(0, 9), tmp_path / "x.gguf")
    with pytest.raises(SliceError, match="already a slice"):
        write_part_slice(GGUFModel(write_part_slice(full, Part.HEAD, out=tmp_path / "h.gguf")), Part.HEAD, out=tmp_path / "hh.gguf")
