"""The verification gate: is a wire codec safe for a model, and does our numpy forward match llama.cpp?

The *remote path* splits each layer's experts into the groups of a partition (as
workers would host them), sends every group's hidden states and partial sums
through the codec (encode -> bytes -> decode) and combines them in protocol
order. The *local path* uses the same grouping without a wire. With f32 the two
must be bit-identical; a lossy codec passes when min cosine >= 0.999 and the
argmax agrees wherever the local top-1/top-2 logit gap exceeds 0.2. The caller
stores the verdict (:mod:`node.verdicts`), so a backbone can refuse a lossy codec
for a model that has not passed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .codecs import Codec, roundtrip
from .errors import CodecError
from .forward import Backbone, KVCache, local_moe
from .gguf_model import GGUFModel
from .hosting import open_experts
from .kernels import Kernel
from .moe import ExpertSource, Partition, Progress, combine, grouped_moe, ungrouped_moe

MIN_COSINE = 0.999
TIE_GAP = 0.2
DEFAULT_PROMPT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep."
)


@dataclass(frozen=True)
class Comparison:
    max_abs_diff: float
    min_cosine: float
    argmax_agree: float  # fraction of compared positions
    positions: int
    near_ties_excluded: int
    bit_identical: bool


def compare(got: np.ndarray, ref: np.ndarray, *, tie_gap: float = TIE_GAP) -> Comparison:
    """Compare logits (positions, vocab); argmax only where the reference's top-2 gap > tie_gap."""
    cos = np.sum(got * ref, axis=-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tie_gap
    agree = got.argmax(-1) == ref.argmax(-1)
    return Comparison(
        max_abs_diff=float(np.abs(got - ref).max()),
        min_cosine=float(cos.min()),
        argmax_agree=float(agree[clear].mean()) if clear.any() else 1.0,
        positions=int(got.shape[0]),
        near_ties_excluded=int((~clear).sum()),
        bit_identical=got.tobytes() == ref.tobytes(),
    )


def wire_moe(source: ExpertSource, partition: Partition, codec: Codec):
    """The remote path, in process: each group's input and answer cross the codec."""

    def moe_ffn(layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        partials = []
        for g in range(len(partition.bounds)):
            held = partition.held_mask(g, ids)
            rows = held.any(axis=1)
            sums = np.zeros_like(x)
            if rows.any():
                got, _ = source.partial_sum(layer, roundtrip(codec, x[rows]), ids[rows], w[rows], held[rows])
                sums[rows] = roundtrip(codec, got)
            partials.append((sums, rows))
        return combine(partials)

    return moe_ffn


def run_gate(model: GGUFModel, codec: Codec, *, kernel: Kernel, groups: int = 3, prompt: str = DEFAULT_PROMPT, reference: str | None = None, progress: Progress | None = None) -> dict:
    """Everything `moeswarm verify` prints, as one dict: the dense part and the experts computed by *kernel*
    (*progress* hears after each forward pass: local, over the wire, ungrouped, llama.cpp)."""
    from .tokenizer import Tokenizer

    passes = 4 if reference else 3

    def done(n: int) -> None:
        if progress:
            progress(n, passes)

    tokens = Tokenizer.from_spec(model.tokenizer_spec).encode(prompt)[: model.cfg.context_length]
    store, _ = open_experts(model, kernel)
    bb = Backbone(model, kernel)
    part = Partition.even(model.cfg.n_expert, groups)
    local = bb.forward(tokens, KVCache(), local_moe(lambda i, x, ids, w: grouped_moe(store, part, i, x, ids, w)))
    done(1)
    remote = bb.forward(tokens, KVCache(), local_moe(wire_moe(store, part, codec)))
    done(2)
    ungrouped = bb.forward(tokens, KVCache(), local_moe(lambda i, x, ids, w: ungrouped_moe(store, i, x, ids, w)))
    done(3)
    rl = compare(remote, local)
    gate_ok = rl.bit_identical if codec is Codec.F32 else (rl.min_cosine >= MIN_COSINE and rl.argmax_agree == 1.0)
    ref = None
    if reference:
        if reference != "llamacpp":
            raise CodecError(f"unknown reference engine {reference!r}; the only one is llamacpp")
        from .reference import llamacpp_logits

        c = compare(ungrouped, llamacpp_logits(model.path, tokens))
        done(4)
        ref = {"engine": "llamacpp", "min_cosine": c.min_cosine, "argmax_agree": c.argmax_agree, "positions": c.positions, "near_ties_excluded": c.near_ties_excluded, "max_abs_diff": c.max_abs_diff}
        gate_ok = gate_ok and c.min_cosine >= MIN_COSINE and c.argmax_agree == 1.0
    verdict = "pass" if gate_ok else "fail"
    return {
        "model_digest": model.digest,
        "model": str(model.path),
        "wire": codec.name.lower(),
        "groups": [list(b) for b in part.bounds],
        "tokens": len(tokens),
        "remote_vs_local": asdict(rl),
        "grouped_vs_ungrouped_max_abs_diff": float(np.abs(local - ungrouped).max()),
        "reference": ref,
        "kernel": str(kernel.identity),
        "verdict": verdict,
    }
