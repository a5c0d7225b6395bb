"""Kimi Delta Attention (kimi-linear's recurrent layers), as llama.cpp's graph and CPU op run it.

Per token of a KDA layer (``src/models/kimi-linear.cpp``, ``delta-net-base.cpp``, ``ops.cpp`` gated_delta_net with
a per-dim g)::

    mixed = [W_q h, W_k h, W_v h]        beta = sigmoid(W_beta h)      (n_head heads of S = kda.head_dim each)
    g = softplus(f_b(f_a(h)) + dt_bias) * ssm_a[head]                  one decay per key dim (ssm_a = -exp(A_log))
    y = silu(causal conv of mixed)   q, k = l2_norm(y_q), l2_norm(y_k)   v = y_v
    S_h[i, :] *= exp(g_h[i]) ; S_h += k (beta_h (v_h - S_h^T k)) ; o_h = S_h^T q / sqrt(S)
    out = W_o concat_h(rms_norm(o_h, ssm_norm) * sigmoid(g_b(g_a(h))_h))

The three convs are per channel, so they run as one over ``mixed`` with the three weights stacked; the recurrence,
its cache rows and its checkpoints (rollback for speculative decoding, prefix reuse) are :mod:`experts.delta_net`'s,
with the decay row n_head * S wide instead of n_head. Nothing of it leaves the backbone: a dispatch carries the FFN
input only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .archs.kda import QKV
from .config import ModelConfig
from .delta_net import head_norm, softplus
from .dense_weights import DenseWeights, Linear, PackedWeights
from .gguf_model import GGUFModel
from .moe import sigmoid


@dataclass(frozen=True)
class KimiDelta:
    """One KDA layer's weights."""

    qkv: tuple[Linear, Linear, Linear]  # attn_q, attn_k, attn_v
    conv: np.ndarray  # (3 n_head S, K): ssm_conv1d_{q,k,v} stacked, in the order of *mixed*
    f_a: Linear  # the decay's low-rank input projection (S, n_embd)
    f_b: Linear
    beta: Linear
    a: np.ndarray  # (n_head,): -exp(A_log)
    dt_bias: np.ndarray  # (n_head S,)
    g_a: Linear  # the output gate's low-rank projections
    g_b: Linear
    norm: np.ndarray  # (S,)
    out: Linear  # attn_output

    @classmethod
    def load(cls, model: GGUFModel, lin: DenseWeights | PackedWeights, b: str) -> KimiDelta:
        d, K = model.dense, model.cfg.ssm_conv
        q, k, v = (lin.linear(b + f"attn_{x}.weight") for x in QKV)
        return cls(
            qkv=(q, k, v),
            conv=np.concatenate([d(b + f"ssm_conv1d_{x}.weight").reshape(-1, K) for x in QKV]),
            f_a=lin.linear(b + "ssm_f_a.weight"),
            f_b=lin.linear(b + "ssm_f_b.weight"),
            beta=lin.linear(b + "ssm_beta.weight"),
            a=d(b + "ssm_a").reshape(-1),
            dt_bias=d(b + "ssm_dt.bias"),
            g_a=lin.linear(b + "ssm_g_a.weight"),
            g_b=lin.linear(b + "ssm_g_b.weight"),
            norm=d(b + "ssm_norm.weight"),
            out=lin.linear(b + "attn_output.weight"),
        )

    def inputs(self, cfg: ModelConfig, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, gate): per token ``[mixed, beta, g]`` (what the cache keeps) and the output gate's logits."""
        n, H, S = h.shape[0], cfg.ssm_v_heads, cfg.ssm_state
        mixed = np.concatenate([w(h) for w in self.qkv], axis=1)
        g = (softplus(self.f_b(self.f_a(h)) + self.dt_bias).reshape(n, H, S) * self.a[:, None]).reshape(n, H * S)
        return np.concatenate([mixed, sigmoid(self.beta(h)), g], axis=1).astype(np.float32), self.g_b(self.g_a(h))

    def output(self, cfg: ModelConfig, o: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """W_o of each head's RMS-normed output gated by sigmoid(gate) (Kimi's FusedRMSNormGated, sigmoid not silu)."""
        n, H, S = o.shape[0], cfg.ssm_v_heads, cfg.ssm_state
        return self.out((head_norm(o, self.norm, cfg.rms_eps) * sigmoid(gate.reshape(n, H, S))).reshape(n, H * S))
