"""gpt-oss (gpt-oss-20b / 120b), src/models/openai-moe.cpp.

Attention with q/k/v/o biases and per-head sinks, a sliding window on even layers (period 2 unless the file says),
YaRN; the router adds a bias, selects on the logits and softmaxes over the selected; SwiGLU-OAI experts with biases;
the FFN pre-norm named post_attention_norm.
"""

from __future__ import annotations

from ..arch import Activation, Gating
from .attention import Attention
from .base import Arch, RandomFeatures
from .ffn import Experts
from .router import RouterSpec
from .window import PeriodicWindow

GPT_OSS = Arch(
    name="gpt-oss",
    attention=Attention(qkv_bias=True, out_bias=True, sinks=True),
    router=RouterSpec(gating=Gating.SOFTMAX_WEIGHT, logit_bias=True),
    experts=Experts(act=Activation.SWIGLU_OAI, biases=True),
    window=PeriodicWindow(period=2),
    ffn_norm="post_attention_norm",
    tied_output=False,
    # a 4-token window on its SWA layers with their own RoPE base, and YaRN (factor 32, as the real models) over an
    # original context of 64, so the ramp between interpolated and extrapolated frequencies falls inside the head
    random=RandomFeatures(n_swa=4, rope_theta_swa=2000.0, yarn_factor=32.0, yarn_orig_ctx=64),
)
