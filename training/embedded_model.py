"""A torch copy of llama.cpp's qwen2moe graph, for training the embedded model.

Every operation mirrors ``src/models/qwen2moe.cpp`` and ``build_moe_ffn`` in
``src/llama-graph.cpp`` (NEOX RoPE, softmax router with top-k weights *not*
renormalised, sigmoid-gated shared expert, untied output), so the weights we
train are the weights llama.cpp runs: ``check_llama.py`` compares the logits.
Parameters are stored in GGUF shapes (numpy order = ggml ``ne`` reversed), so
export is a rename, never a transpose.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from experts.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_rms_norm followed by the weight multiply: x / sqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_neox(x: torch.Tensor, theta: float) -> torch.Tensor:
    """NEOX RoPE on (batch, heads, seq, head_dim): dimension i pairs with i + head_dim/2."""
    seq, d = x.shape[-2], x.shape[-1]
    half = d // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    """One qwen2moe layer: attention, then routed experts plus the gated shared expert."""

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0) -> None:
        super().__init__()
        d, e, ff, s = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
        self.cfg = cfg
        self.dropout = nn.Dropout(dropout)  # training only; llama.cpp has none, so eval() matches it
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn_q = nn.Linear(d, cfg.q_dim)
        self.attn_k = nn.Linear(d, cfg.kv_dim)
        self.attn_v = nn.Linear(d, cfg.kv_dim)
        self.attn_output = nn.Linear(cfg.q_dim, d, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.ffn_gate_inp = nn.Parameter(torch.empty(e, d))
        self.ffn_gate_exps = nn.Parameter(torch.empty(e, ff, d))
        self.ffn_up_exps = nn.Parameter(torch.empty(e, ff, d))
        self.ffn_down_exps = nn.Parameter(torch.empty(e, d, ff))
        self.ffn_gate_inp_shexp = nn.Parameter(torch.empty(d))
        self.ffn_gate_shexp = nn.Linear(d, s, bias=False)
        self.ffn_up_shexp = nn.Linear(d, s, bias=False)
        self.ffn_down_shexp = nn.Linear(s, d, bias=False)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = h.shape
        q = self.attn_q(h).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = self.attn_k(h).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        v = self.attn_v(h).view(b, t, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        q, k = rope_neox(q, cfg.rope_theta), rope_neox(k, cfg.rope_theta)
        # ggml broadcasts K/V head j to query heads j*g .. j*g+g-1, which is repeat_interleave.
        g = cfg.n_head // cfg.n_head_kv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_dim))
        return self.attn_output(y.transpose(1, 2).reshape(b, t, cfg.q_dim))

    def routed(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token on (tokens, n_embd); returns the output and the load-balancing loss.

        Token copies are sorted by expert and split into one contiguous chunk per
        expert, so the cost does not depend on how balanced the routing is and no
        token is ever dropped.
        """
        cfg = self.cfg
        n, k = h.shape[0], cfg.n_expert_used
        probs = torch.softmax(h @ self.ffn_gate_inp.T, dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # qwen2moe: the k weights are not renormalised
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=cfg.n_expert)
        self.last_counts = counts  # tokens per expert in the latest call, for diagnostics
        outs = [
            self.expert(e, x) for e, x in enumerate(h.index_select(0, token_of).split(counts.tolist())) if len(x)
        ]
        out = torch.cat(outs) * weights.reshape(-1)[order, None]
        y = h.new_zeros(h.shape).index_add(0, token_of, out)
        # Switch-transformer balance loss: n_expert * sum_e (share of slots to e) * (mean prob of e).
        aux = cfg.n_expert * torch.sum(counts.to(h.dtype) / (n * k) * probs.mean(0))
        return y, aux

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.ffn_gate_exps[e])) * F.linear(x, self.ffn_up_exps[e]), self.ffn_down_exps[e])

    def shared(self, h: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(h @ self.ffn_gate_inp_shexp)[..., None]
        return self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(h)) * self.ffn_up_shexp(h)) * gate

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_eps
        x = x + self.dropout(self.attention(rms_norm(x, self.attn_norm, eps)))
        h = rms_norm(x, self.ffn_norm, eps)
        routed, aux = self.routed(h.reshape(-1, h.shape[-1]))
        return x + self.dropout(routed.view_as(h) + self.shared(h)), aux

    def gguf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            prefix + "attn_norm.weight": self.attn_norm,
            prefix + "attn_q.weight": self.attn_q.weight,
            prefix + "attn_q.bias": self.attn_q.bias,
            prefix + "attn_k.weight": self.attn_k.weight,
            prefix + "attn_k.bias": self.attn_k.bias,
            prefix + "attn_v.weight": self.attn_v.weight,
            prefix + "attn_v.bias": self.attn_v.bias,
            prefix + "attn_output.weight": self.attn_output.weight,
            prefix + "ffn_norm.weight": self.ffn_norm,
            prefix + "ffn_gate_inp.weight": self.ffn_gate_inp,
            prefix + "ffn_gate_exps.weight": self.ffn_gate_exps,
            prefix + "ffn_up_exps.weight": self.ffn_up_exps,
            prefix + "ffn_down_exps.weight": self.ffn_down_exps,
            prefix + "ffn_gate_inp_shexp.weight": self.ffn_gate_inp_shexp,
            prefix + "ffn_gate_shexp.weight": self.ffn_gate_shexp.weight,
            prefix + "ffn_up_shexp.weight": self.ffn_up_shexp.weight,
            prefix + "ffn_down_shexp.weight": self.ffn_down_shexp.weight,
        }


class Qwen2MoeLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, n_vocab), plus the mean balance loss."""

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0) -> None:
        super().__init__()
        if cfg.arch != "qwen2moe" or not cfg.n_ff_shexp:
            raise ValueError("this trainer implements qwen2moe with a shared expert only")
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, dropout) for _ in range(cfg.n_layer))
        self.output_norm = nn.Parameter(torch.ones(cfg.n_embd))
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections shrunk by sqrt(2 * n_layer), zero biases."""
        std = 0.02
        resid = std / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif "attn_output" in name or "down" in name:
                nn.init.normal_(p, std=resid)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok_embd(ids)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        x = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        return self.output(x), aux / len(self.blocks)

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters under their GGUF names, already in GGUF numpy shapes."""
        out = {
            "token_embd.weight": self.tok_embd.weight,
            "output_norm.weight": self.output_norm,
            "output.weight": self.output.weight,
        }
        for i, block in enumerate(self.blocks):
            out |= block.gguf_tensors(f"blk.{i}.")
        return out

    def export_arrays(self) -> dict[str, np.ndarray]:
        return {name: t.detach().cpu().numpy().astype(np.float32) for name, t in self.gguf_tensors().items()}

    @torch.no_grad()
    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`export_arrays` (e.g. tensors read back from the GGUF)."""
        for name, t in self.gguf_tensors().items():
            t.copy_(torch.from_numpy(np.asarray(arrays[name], dtype=np.float32).reshape(t.shape)))

    @torch.no_grad()
    def greedy(self, ids: list[int], n_new: int) -> list[int]:
        """Greedy continuation, recomputing the whole window each step (the model is tiny)."""
        ids = list(ids)
        for _ in range(n_new):
            window = ids[-self.cfg.context_length :]
            logits, _ = self(torch.tensor([window]))
            ids.append(int(logits[0, -1].argmax()))
        return ids
