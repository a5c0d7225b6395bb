"""Random, valid packed weights of every quant type, for the self-test, the tests and the benchmark.

gguf-py quantizes F16/BF16/Q8_0/Q4_x/Q5_x, so those are real quantizations of Gaussian
weights. It cannot quantize K-quants, so K-quant blocks are random bytes with their f16
super-block scales set to sane values (``experts.random_model.random_k_blocks``); the
super-block *min* of the asymmetric types is then set so the weights are centred on zero, as
trained weights are: a large common offset would make every dot product a near-cancellation
and exaggerate the (legitimate) quantized-activation error of fast kernels.
"""

from __future__ import annotations

import gguf
import numpy as np

from ..random_model import K_QUANT_SCALES, random_k_blocks

Q = gguf.GGMLQuantizationType

# (offset of d, offset of dmin, mean of scale*quant / mean of min): dmin = ratio * d centres the values.
_K_MIN_CENTRE = {Q.Q2_K: (80, 82, 1.5), Q.Q4_K: (0, 2, 7.5), Q.Q5_K: (0, 2, 15.5)}


def random_weight(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator, std: float = 0.05) -> np.ndarray:
    """Packed bytes of a random weight of numpy *shape* (last dim = row length): uint8 (*shape[:-1], row_bytes)."""
    if qtype in K_QUANT_SCALES:
        blocks = random_k_blocks(qtype, shape, std, rng)
        if qtype in _K_MIN_CENTRE:
            d_off, m_off, ratio = _K_MIN_CENTRE[qtype]
            flat = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
            d = flat[:, d_off : d_off + 2].copy().view(np.float16)
            flat[:, m_off : m_off + 2] = (d * np.float16(ratio)).view(np.uint8)
        return blocks
    w = (rng.standard_normal(shape) * std).astype(np.float32)
    if qtype == Q.F32:
        return w.view(np.uint8).reshape(*shape[:-1], shape[-1] * 4)
    return np.asarray(gguf.quants.quantize(w, qtype)).view(np.uint8)


def random_expert_stack(qtype: gguf.GGMLQuantizationType, n_expert: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A stacked expert tensor as the file lays it out: uint8 (n_expert, rows * row_bytes)."""
    return random_weight(qtype, (n_expert, rows, cols), rng).reshape(n_expert, -1)
