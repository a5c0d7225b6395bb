"""Hyper-parameters of a MoE model, as read from (or written to) GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from .arch import ArchSpec, arch_spec


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0  # 0: no shared expert
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    context_length: int = 2048
    name: str = "moeswarm-model"

    @property
    def spec(self) -> ArchSpec:
        return arch_spec(self.arch)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class TokenizerSpec:
    """The ``tokenizer.ggml.*`` metadata: enough for llama.cpp and for :mod:`experts.tokenizer`."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    bos_id: int
    eos_id: int
    pre: str = "default"
    scores: list[float] | None = None  # SPM
    merges: list[str] | None = None  # BPE: "a b" per merge, highest priority first
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    extra: dict = field(default_factory=dict)
