"""Gated delta-net linear attention (qwen3next / qwen35moe), token by token as llama.cpp's CPU op runs it.

Per token t of a recurrent layer (``src/models/qwen3next.cpp``, ``delta-net-base.cpp``, ``ops.cpp`` ssm_conv and
gated_delta_net)::

    mixed = W_qkv h (q, k: n_k heads; v: n_v heads)   z = W_gate h   beta = sigmoid(W_b h)
    g = softplus(W_a h + dt_bias) * ssm_a                               (ssm_a = -exp(A_log), converted)
    y = silu(sum_k mixed[t - (K-1) + k] * conv[:, k])                   causal conv over the last K inputs (zeros before 0)
    q, k = y_q / sqrt(|y_q|^2 + eps), y_k / ...                          per head; v = y_v
    S_h = exp(g_h) S_h ; S_h += k (beta_h (v_h - S_h^T k)) ; o_h = S_h^T q / sqrt(S)   state S_h[key i][value j]
    out = W_out concat_h(rms_norm(o_h, ssm_norm) * silu(z_h))

V head j reads K head ``j // (n_v / n_k)`` (qwen3next repeats each k head) or ``j % n_k`` (qwen35moe's tiled heads).

The cache of a recurrent layer (``KVCache.k[i]``) holds, per position, what the recurrence reads: the projected
``mixed`` row, beta and g (``cfg.gdn_conv_dim + 2 n_v`` floats). The matrix state is kept as checkpoints
(``KVCache.states[i]``): at every multiple of :data:`CHECKPOINT_EVERY` positions and at the end of the last two
forward calls. Rolling back (rejected draft tokens, a taint cut, a prefix reused from the prefix cache) only drops
rows and later checkpoints; the next forward recomputes the state from the latest checkpoint at or before its start,
with the same per-token code, so the bits are those of an uninterrupted run. Chosen over a state snapshot per token
by measurement at Qwen3-Next's sizes (32 V heads of 128, 16 K heads, conv_dim 8192): a snapshot is 2 MiB per token
per layer against 33 KB of rows, and recomputing costs 1.25-1.34 ms per token per layer (numpy, one thread, on the
shared 2-core machine at load ~6). With checkpoints every 64 positions they add ~32 KB per token; a rejected draft
(the common rollback) resumes from the previous call's end and recomputes only its accepted tokens, a prefix reused
from the prefix cache recomputes at most 63 positions per recurrent layer instead of prefilling the whole prefix again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .archs.gdn import GatedDeltaNet
from .config import ModelConfig
from .dense_weights import DenseWeights, Linear, PackedWeights
from .gguf_model import GGUFModel
from .moe import sigmoid

CHECKPOINT_EVERY = 64  # positions between kept matrix states of a recurrent layer


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's softplus: x above 20, else log(1 + e^x), in float32."""
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log(np.float32(1.0) + np.exp(x))).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """llama.cpp's ``build_gdn_l2_norm``: rms_norm(x, eps / S) / sqrt(S) over the last axis."""
    n = x.shape[-1]
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps / n).astype(np.float32) * np.float32(1.0 / np.sqrt(n))


@dataclass(frozen=True)
class DeltaNet:
    """One recurrent layer's weights."""

    qkv: Linear | None  # attn_qkv; None when the file has the legacy ssm_in
    z: Linear | None  # attn_gate
    ssm_in: Linear | None  # legacy qwen3next: per k head [q, k, v, z] rows
    ba: Linear | None  # qwen3next: per k head [beta (r), alpha (r)] rows
    beta: Linear | None  # qwen35moe
    alpha: Linear | None
    conv: np.ndarray  # (conv_dim, K)
    dt_bias: np.ndarray  # (n_v,)
    a: np.ndarray  # (n_v,)
    norm: np.ndarray  # (S,)
    out: Linear  # ssm_out

    @classmethod
    def load(cls, model: GGUFModel, lin: DenseWeights | PackedWeights, b: str) -> DeltaNet:
        d, legacy, split = model.dense, model.has(b + "ssm_in.weight"), _spec(model.cfg).split_ba
        return cls(
            qkv=None if legacy else lin.linear(b + "attn_qkv.weight"),
            z=None if legacy else lin.linear(b + "attn_gate.weight"),
            ssm_in=lin.linear(b + "ssm_in.weight") if legacy else None,
            ba=None if split else lin.linear(b + "ssm_ba.weight"),
            beta=lin.linear(b + "ssm_beta.weight") if split else None,
            alpha=lin.linear(b + "ssm_alpha.weight") if split else None,
            conv=d(b + "ssm_conv1d.weight"),
            dt_bias=d(b + "ssm_dt.bias"),
            a=d(b + "ssm_a"),
            norm=d(b + "ssm_norm.weight"),
            out=lin.linear(b + "ssm_out.weight"),
        )

    def inputs(self, cfg: ModelConfig, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, z): per token the recurrence's inputs ``[mixed, beta, g]`` (what the cache keeps) and the output gate."""
        n, n_k, n_v, S = h.shape[0], cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
        r = n_v // n_k
        if self.ssm_in is not None:  # the legacy layout, regrouped as llama.cpp's build_qkvz does
            y = self.ssm_in(h).reshape(n, n_k, 2 * S + 2 * r * S)
            q, k, v, zz = y[..., :S], y[..., S : 2 * S], y[..., 2 * S : 2 * S + r * S], y[..., 2 * S + r * S :]
            mixed = np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=1)
            z = np.ascontiguousarray(zz.reshape(n, n_v * S))
        else:
            assert self.qkv is not None and self.z is not None
            mixed, z = self.qkv(h), self.z(h)
        if self.ba is not None:
            ba = self.ba(h).reshape(n, n_k, 2, r)
            b, alpha = ba[:, :, 0].reshape(n, n_v), ba[:, :, 1].reshape(n, n_v)
        else:
            assert self.beta is not None and self.alpha is not None
            b, alpha = self.beta(h), self.alpha(h)
        g = softplus(alpha + self.dt_bias) * self.a
        return np.concatenate([mixed, sigmoid(b), g], axis=1).astype(np.float32), z

    def output(self, cfg: ModelConfig, o: np.ndarray, z: np.ndarray) -> np.ndarray:
        """W_out of each head's RMS-normed output gated by silu(z)."""
        n, n_v, S = o.shape[0], cfg.ssm_v_heads, cfg.ssm_state
        return self.out((head_norm(o, self.norm, cfg.rms_eps) * silu(z.reshape(n, n_v, S))).reshape(n, n_v * S))


def head_norm(o: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Each head's output (n, heads, S) RMS-normed over its S values, times the norm weight (both recurrences)."""
    ms = np.mean(o.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return o / np.sqrt(ms + eps).astype(np.float32) * weight


def key_heads(cfg: ModelConfig) -> np.ndarray:
    """The k head each v head reads: grouped (qwen3next) or tiled (qwen35moe)."""
    j = np.arange(cfg.ssm_v_heads)
    if cfg.ssm_k_heads == cfg.ssm_v_heads:  # one key head per value head (and KDA, which has no gated delta-net spec)
        return j
    return j % cfg.ssm_k_heads if _spec(cfg).tiled_v else j // (cfg.ssm_v_heads // cfg.ssm_k_heads)


def _spec(cfg: ModelConfig) -> GatedDeltaNet:
    """The hybrid's layout facts (tiled V heads, split beta/alpha) from the model's arch."""
    attention = cfg.spec.attention
    assert isinstance(attention, GatedDeltaNet), f"{cfg.arch} has no gated delta-net layers"
    return attention


def scan(cfg: ModelConfig, conv: np.ndarray, rows: np.ndarray, start: int, stop: int, state: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """Run positions start..stop-1 of a recurrent layer over its cached *rows* from *state* (the state after *start*
    positions): (outputs (stop - start, n_v, S), the state after *stop*, the states at multiples of
    :data:`CHECKPOINT_EVERY` on the way). A row is ``[mixed, beta (n_v), g]`` with g one decay per head (gated
    delta-net) or one per key dim of each head (KDA, :mod:`experts.kda`: n_v * S floats). One token at a time with the same shapes whatever the batch, so the bits
    of a position never depend on how its tokens were grouped into calls (or whether it is recomputed)."""
    K, n_k, n_v, S = cfg.ssm_conv, cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
    cd, kd = cfg.gdn_conv_dim, cfg.gdn_key_dim
    heads, scale = key_heads(cfg), np.float32(1.0 / np.sqrt(S))
    lo = max(0, start - (K - 1))
    mixed = np.concatenate([np.zeros((K - 1 - (start - lo), cd), dtype=np.float32), rows[lo:stop, :cd]])
    y = mixed[0 : stop - start] * conv[:, 0]  # the causal conv, tap by tap in ggml's order
    for tap in range(1, K):
        y = y + mixed[tap : tap + stop - start] * conv[:, tap]
    y = silu(y)
    q = l2_norm(y[:, :kd].reshape(-1, n_k, S), cfg.rms_eps)[:, heads]
    k = l2_norm(y[:, kd : 2 * kd].reshape(-1, n_k, S), cfg.rms_eps)[:, heads]
    v = y[:, 2 * kd :].reshape(-1, n_v, S)
    beta, g = rows[start:stop, cd : cd + n_v], rows[start:stop, cd + n_v :].reshape(stop - start, n_v, -1)
    out = np.empty((stop - start, n_v, S), dtype=np.float32)
    kept = {}
    for t in range(stop - start):
        state = state * np.exp(g[t])[:, :, None]  # g[t] (n_v, 1): one decay per head; (n_v, S) under KDA: per key dim
        kt = np.ascontiguousarray(k[t])[:, None, :]  # (n_v, 1, S)
        delta = (v[t] - np.matmul(kt, state)[:, 0]) * beta[t][:, None]
        state = state + kt.transpose(0, 2, 1) * delta[:, None, :]
        out[t] = np.matmul(np.ascontiguousarray(q[t])[:, None, :], state)[:, 0] * scale
        if (start + t + 1) % CHECKPOINT_EVERY == 0:
            kept[start + t + 1] = state
    return out, state, kept


def advance(cfg: ModelConfig, conv: np.ndarray, rows: np.ndarray, kept: dict[int, np.ndarray], start: int, n: int) -> np.ndarray:
    """Outputs of positions start..start+n-1 over the layer's cached *rows*, the layer's checkpoints *kept* updated:
    the state is brought to *start* from the latest checkpoint at or before it (recomputed after a rollback), then
    run; kept are the multiples of :data:`CHECKPOINT_EVERY` and the ends of the last two calls (a rejected draft
    resumes from the earlier one)."""
    c = max((p for p in kept if p <= start), default=0)
    state = kept[c] if c else np.zeros((cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state), dtype=np.float32)
    if c < start:
        _, state, more = scan(cfg, conv, rows, c, start, state)
        kept.update(more)
    out, end, more = scan(cfg, conv, rows, start, start + n, state)
    kept.update(more)
    kept[start], kept[start + n] = state, end
    for p in [p for p in kept if p % CHECKPOINT_EVERY and p not in (start, start + n)]:
        del kept[p]
    return out
