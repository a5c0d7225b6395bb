"""The family modules of experts/archs: each writes what it reads, and an arch composed of the shared parts runs end
to end from its registry line alone (nothing else in the code branches on an arch's name)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experts.arch import QKNorm
from experts.archs import ARCHS, Arch
from experts.archs.attention import Attention
from experts.archs.router import RouterSpec
from experts.forward import Backbone, KVCache, local_moe
from experts.gguf_model import GGUFModel
from experts.moe import ungrouped_moe
from experts.random_model import random_config, write_random_model
from experts.slices import ExpertStore


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_family_reads_back_the_config_it_wrote(tmp_path, arch):
    """random config -> the family's writer -> the family's reader gives the same config, field for field (all 16 archs)."""
    cfg = random_config(arch, n_layer=3)
    p = tmp_path / f"{arch}.gguf"
    write_random_model(p, cfg)
    got = GGUFModel(p).cfg
    cfg = dataclasses.replace(cfg, rms_eps=float(np.float32(cfg.rms_eps)))  # GGUF stores the epsilon as float32
    assert got == cfg, {f.name: (getattr(cfg, f.name), getattr(got, f.name)) for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(got, f.name)}


def _logits(path) -> np.ndarray:
    m = GGUFModel(path)
    store = ExpertStore(m)
    return Backbone(m).forward([1, 2, 3, 4, 5], KVCache(), local_moe(lambda i, x, e, w: ungrouped_moe(store, i, x, e, w)))


def test_a_new_arch_is_its_parts_and_a_registry_line(tmp_path, monkeypatch):
    """An arch made of qwen3moe's parts under another name: its random model has qwen3moe's tensors bit for bit and
    computes qwen3moe's logits bit for bit, with no other change anywhere."""
    toy = Arch(name="toymoe", attention=Attention(qk_norm=QKNorm.PER_HEAD), router=RouterSpec(norm=True))
    monkeypatch.setitem(ARCHS, "toymoe", toy)
    a, b = tmp_path / "qwen3moe.gguf", tmp_path / "toymoe.gguf"
    write_random_model(a, random_config("qwen3moe", n_layer=2), seed=5)
    write_random_model(b, random_config("toymoe", n_layer=2), seed=5)
    ma, mb = GGUFModel(a), GGUFModel(b)
    assert mb.cfg.arch == "toymoe" and ma.manifest[1:] == mb.manifest[1:]  # every tensor line: name, type, shape, hash
    assert _logits(a).tobytes() == _logits(b).tobytes()
    other = dataclasses.replace(toy, router=RouterSpec(norm=False))  # one part changed: another model
    monkeypatch.setitem(ARCHS, "toymoe", other)
    assert not np.array_equal(_logits(a), _logits(b))
