"""The cheap extras' random models exercise what sets each arch apart: leaving out any one feature (done right,
the F32 gate passes: test_reference) drops the cosine to llama.cpp below 0.9999."""

from __future__ import annotations

import dataclasses

import pytest

from experts.arch import RopeStyle
from experts.forward import KVCache
from experts.gguf_model import GGUFModel
from experts.verify import compare

from ..conftest import make_model
from .test_reference import SHAPE, TOKENS, engine

pytestmark = pytest.mark.llama


def _layers(**change):
    return lambda bb: setattr(bb, "layers", [dataclasses.replace(L, **change) for L in bb.layers])


def _router(**change):
    return lambda bb: setattr(bb, "router_params", dataclasses.replace(bb.router_params, **change))


def _other_rope(bb):
    other = RopeStyle.NORM if bb.arch.attention.rope is RopeStyle.NEOX else RopeStyle.NEOX
    bb.arch = dataclasses.replace(bb.arch, attention=dataclasses.replace(bb.arch.attention, rope=other))


ABLATIONS = {
    "rope style": _other_rope,
    "q/k norm": _layers(q_norm=None),
    "partial rope": lambda bb: setattr(bb, "cfg", dataclasses.replace(bb.cfg, n_rot=0)),
    "renormalisation": _router(norm=False),
    "routed scale": _router(scale=0.0),
    "expert groups": _router(n_groups=0),
    "selection bias": _layers(selection_bias=None),
    "shared expert": _layers(shexp=None),
}
FEATURES = {
    "qwen3vlmoe": ("rope style", "q/k norm", "renormalisation"),
    "dots1": ("rope style", "q/k norm", "renormalisation", "routed scale", "expert groups", "selection bias", "shared expert"),
    "ernie4_5-moe": ("rope style", "renormalisation", "expert groups", "selection bias", "shared expert"),
    "bailingmoe2": ("rope style", "q/k norm", "partial rope", "renormalisation", "routed scale", "expert groups", "selection bias", "shared expert"),
}


@pytest.mark.parametrize("arch, feature", [(a, f) for a, fs in FEATURES.items() for f in fs])
def test_every_feature_of_the_extras_random_models_matters(model_dir, arch, feature):
    """Each feature the arch's llama.cpp graph has is on in its random model and changes the logits."""
    pytest.importorskip("llama_cpp")
    from experts.reference import llamacpp_logits

    path = make_model(model_dir, arch, **SHAPE)
    bb, hook = engine(GGUFModel(path), "reference")
    ABLATIONS[feature](bb)
    c = compare(bb.forward(TOKENS, KVCache(), hook), llamacpp_logits(path, TOKENS))
    assert c.min_cosine < 0.9999, c
