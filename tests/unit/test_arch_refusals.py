"""Every arch of the table: a file missing a key the model needs, or carrying a tensor moeswarm does not read
(an NVFP4 ``*.scale``), is refused with one line naming it, never loaded and computed without it."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts.archs import ARCHS, Arch
from experts.errors import ModelFormatError
from experts.gguf_model import GGUFModel
from experts.model_writer import write_model
from experts.random_model import byte_level_tokenizer, random_config, random_tensors

ALL_ARCHS = sorted(ARCHS)


def required_keys(arch: Arch, n_dense_lead: int, n_groups: int) -> set[str]:
    """The arch keys llama.cpp refuses a file without, as the arch's parts declare them (without the arch prefix),
    and those its shape needs."""
    keys = arch.required_keys()
    keys |= {"feed_forward_length"} if n_dense_lead else set()
    keys |= {"expert_group_used_count"} if n_groups > 1 else set()  # without it llama.cpp asserts, we masked every expert
    return keys


def write_without(path, arch: str, dropped: str, monkeypatch, extra_tensors=None) -> None:
    """A random model of *arch* whose writer skipped the key *dropped* (full name)."""
    cfg = random_config(arch, n_layer=3)
    add = gguf.GGUFWriter.add_key_value
    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_key_value", lambda self, key, *a, **kw: None if key == dropped else add(self, key, *a, **kw))
        write_model(path, cfg, {**random_tensors(cfg), **(extra_tensors or {})}, byte_level_tokenizer())


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_a_missing_key_is_named_in_one_line_or_has_llama_cpps_default(tmp_path, monkeypatch, arch):
    """Drop each arch key in turn: the file still loads (the key is optional, as in llama.cpp) or fails with one
    line; when the table says llama.cpp needs the key, that line names it."""
    cfg = random_config(arch, n_layer=3)
    full = tmp_path / "full.gguf"
    write_without(full, arch, "", monkeypatch)
    keys = [k for k in gguf.GGUFReader(full).fields if k.startswith(arch + ".") or k == "general.architecture"]
    required = {arch + "." + k for k in required_keys(cfg.spec, cfg.n_dense_lead, cfg.n_expert_groups)} | {"general.architecture"}
    assert required <= set(keys), required - set(keys)
    for key in keys:
        p = tmp_path / f"no-{key}.gguf"
        write_without(p, arch, key, monkeypatch)
        try:
            GGUFModel(p)
        except ModelFormatError as err:
            assert "\n" not in str(err), (key, str(err))
            if key in required:
                assert key in str(err), (key, str(err))
        else:
            assert key not in required, f"{key} is required for {arch} but a file without it loaded"


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("tensor", ["blk.1.ffn_down_exps.scale", "blk.1.attn_q.scale", "blk.1.ffn_made_up.weight"])
def test_an_unknown_tensor_is_named_in_one_line(tmp_path, monkeypatch, arch, tensor):
    """An NVFP4 per-expert or per-tensor scale (llama.cpp would multiply by it) or any other unread tensor."""
    cfg = random_config(arch, n_layer=3)
    shape = (cfg.n_expert,) if "_exps" in tensor else (1,) if tensor.endswith(".scale") else (4, cfg.n_embd)
    p = tmp_path / "extra.gguf"
    write_without(p, arch, "", monkeypatch, {tensor: np.ones(shape, dtype=np.float32)})
    with pytest.raises(ModelFormatError) as err:
        GGUFModel(p)
    msg = str(err.value)
    assert f"tensor {tensor} " in msg and "not one moeswarm reads" in msg and "\n" not in msg


@pytest.mark.parametrize("groups, used", [(4, 4), (4, 0), (3, 1), (8, 2)])
def test_expert_groups_llama_cpp_cannot_run_are_refused(tmp_path, groups, used):
    """Groups must divide the experts, number fewer than them, and keep 0 < used < groups (llama.cpp asserts it;
    a used count of 0 would mask every expert)."""
    cfg = dataclasses.replace(random_config("glm4moe", n_layer=3), n_expert_groups=groups, n_group_used=used)
    p = tmp_path / "groups.gguf"
    write_model(p, cfg, random_tensors(cfg), byte_level_tokenizer())
    with pytest.raises(ModelFormatError, match="expert_group_count .* do not fit 8 experts"):
        GGUFModel(p)
