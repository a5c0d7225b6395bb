"""Random MoE models of any shape, written as real GGUF files llama.cpp loads.

Tests and benchmarks need models of many shapes and quantizations without a
download. gguf-py quantizes F16/BF16/Q8_0/Q4_x/Q5_x but no K-quant, so K-quant
tensors are made of random blocks whose f16 scale fields are set to sane values:
the bytes are valid blocks of that type, which is all a reader or benchmark needs.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .archs import arch_spec
from .config import ModelConfig, TokenizerSpec
from .errors import ModelFormatError, UsageError
from .model_writer import PlannedTensor, expected_shapes, keeps_f32, pack_tensor, write_model, write_streamed

Q = gguf.GGMLQuantizationType
GGUFPY_QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4}
# Byte offsets of the f16 super-block scales (d, and dmin where present) in each K-quant block.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SUPPORTED_QTYPES = GGUFPY_QUANTIZABLE | set(K_QUANT_SCALES)
K_BLOCK = 256
# llama-quantize's tensor_type_fallback (src/llama-quant.cpp): a tensor whose rows are not whole K-quant blocks gets this.
K_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocabularies store)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def byte_level_tokenizer() -> TokenizerSpec:
    """256 byte tokens, a few merges (llama.cpp requires the merges key) and <|endoftext|>."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    sp = b2u[ord(" ")]
    pairs = [(sp, "t"), ("t", "h"), ("h", "e"), (sp + "t", "he"), ("i", "n"), ("e", "r"), ("a", "n"), (sp, "a")]
    merges = []
    for a, b in pairs:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    eot = len(tokens)
    tokens.append("<|endoftext|>")
    types = [int(gguf.TokenType.NORMAL)] * eot + [int(gguf.TokenType.CONTROL)]
    return TokenizerSpec(model="gpt2", pre="gpt-2", tokens=tokens, token_types=types, merges=merges, bos_id=eot, eos_id=eot)


def random_config(arch: str, *, n_vocab: int | None = None, **shape: Any) -> ModelConfig:
    """A small model of *arch* with every feature of the arch on: the family's ``random`` features, the shape
    keywords of :meth:`experts.archs.Arch.random_config` (n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert,
    n_expert_used, n_ff_exp, n_ff_shexp, mla_kv_b). The vocabulary defaults to the byte-level tokenizer's."""
    return arch_spec(arch).random_config(n_vocab=n_vocab or len(byte_level_tokenizer().tokens), **shape)


def with_settings(cfg: ModelConfig, settings: Sequence[str]) -> ModelConfig:
    """*cfg* with ``field=value`` settings applied (``moeswarm model random --set``), each value read as its
    :class:`ModelConfig` field's type (a tuple: comma-separated; ``none`` where the field may be None); the result
    is checked as the arch checks a file it opens, so a setting llama.cpp could not run is refused before writing.

    Why generic: every arch has options beyond the common shape flags (an indexer's top-k, a window, a clamp), and
    one flag per option per arch would not scale; the field names are the config's, as ``inspect --json`` shows them.
    """
    hints = typing.get_type_hints(ModelConfig)
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"arch"}
    changes: dict[str, Any] = {}
    for item in settings:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in names:
            raise UsageError(f"--set {item!r}: give FIELD=VALUE with FIELD one of " + ", ".join(sorted(names)))
        try:
            changes[key] = _parse_setting(hints[key], text.strip())
        except ValueError:
            kind = hints[key]
            raise UsageError(f"--set {item!r}: {text!r} is not a {kind.__name__ if isinstance(kind, type) else kind}") from None
    out = dataclasses.replace(cfg, **changes)
    out.spec.check(out)
    return out


def _parse_setting(kind: Any, text: str) -> Any:
    """*text* as a value of the type *kind* (int, float, bool, str, ``X | None``, ``tuple[X, ...]``)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is tuple:
        return tuple(_parse_setting(args[0], t.strip()) for t in text.split(",") if t.strip())
    if len(args) == 1:  # X | None
        return None if text.lower() == "none" else _parse_setting(args[0], text)
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    return kind(text)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights with fan-in scaling; the router is sharper than init so top-k choices are clear."""
    return dict(_random_arrays(cfg, seed))


# Normals drawn at a time for a matrix: a fixed 32 MB of float64 scratch, whatever the tensor's size.
DRAW_CHUNK = 1 << 22


def _random_arrays(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """``random_tensors`` one tensor at a time, so a writer can pack each before the next exists."""
    rng = np.random.default_rng(seed)
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("exp_probs_b.bias"):
            arr = 0.1 * rng.standard_normal(shape)  # a selection bias on sigmoid probabilities: small, but it moves choices
        elif name.endswith(("ffn_gate_exps.bias", "ffn_up_exps.bias")):
            arr = 3.0 * rng.standard_normal(shape)  # wide enough that SwiGLU-OAI's clamps at +-7 bite on some rows
        elif name == "rope_freqs.weight":
            arr = rng.uniform(1.0, 8.0, shape)  # llama3-style factors (1 for fast pairs up to rope.scaling.factor): every pair's angle moves
        elif name.endswith("ssm_a"):
            arr = -rng.uniform(0.05, 0.5, shape)  # -exp(A_log), as converted: each head's state decays by exp(a * softplus(.))
        elif name.endswith("attn_sinks.weight"):
            arr = 2.0 + rng.standard_normal(shape)  # sink logits above the typical score: they take a visible share
        elif name.endswith(("ffn_gate_inp.bias", "_exps.bias", "indexer.k_norm.bias")):
            arr = rng.standard_normal(shape)  # centred: a router bias of ~1 everywhere would change little (an indexer key's, lift every score alike)
        elif len(shape) == 1:
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            std = 1.0 / np.sqrt(shape[-1])
            if name.endswith("ffn_gate_inp.weight"):
                std *= 4.0
            elif name == "token_embd.weight":
                std = 1.0
            arr = _scaled_normals(rng, shape, std)
        yield name, np.asarray(arr, dtype=np.float32)


def _scaled_normals(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """``(std * rng.standard_normal(shape)).astype(np.float32)`` drawn :data:`DRAW_CHUNK` at a time.

    The same values bit for bit (the generator fills an array in C order, one draw after another, and each product
    is rounded to float32 once either way), without the tensor's float64 copy and its temporaries: a 128-expert
    matrix of a 30B-shaped model is 1.6 GB as float64.
    """
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    scratch = np.empty(min(DRAW_CHUNK, flat.size))
    for start in range(0, flat.size, DRAW_CHUNK):
        n = min(DRAW_CHUNK, flat.size - start)
        np.multiply(rng.standard_normal(out=scratch[:n]), std, out=flat[start : start + n], casting="same_kind")
    return out


def random_k_blocks(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks whose dequantized values have roughly *std*."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ModelFormatError(f"{qtype.name} needs rows that are a multiple of {block}; got row length {shape[-1]}")
    n_blocks = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    offsets = K_QUANT_SCALES[qtype]
    unit = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for off in offsets:
        blocks[:, off : off + 2] = unit
    probe = gguf.quants.dequantize(blocks[: min(64, n_blocks)], qtype)
    scale = np.frombuffer(np.float16(std / max(float(probe.std()), 1e-12)).tobytes(), dtype=np.uint8)
    for off in offsets:
        blocks[:, off : off + 2] = scale
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def write_random_model(
    path: str | Path,
    cfg: ModelConfig,
    *,
    qtype: gguf.GGMLQuantizationType = Q.F32,
    seed: int = 0,
) -> None:
    """Write a random model; matrices in *qtype* (router, norms and biases stay F32).

    The file is streamed (:func:`write_streamed`): the process holds one tensor at a time, never the model.
    """
    if qtype not in SUPPORTED_QTYPES:
        names = ", ".join(sorted(q.name for q in SUPPORTED_QTYPES))
        raise ModelFormatError(f"cannot generate {qtype.name} tensors; choose one of {names}")
    tok = byte_level_tokenizer()
    if len(tok.tokens) != cfg.n_vocab:
        raise ModelFormatError(f"random models use the {len(tok.tokens)}-token byte-level vocabulary, not {cfg.n_vocab}")
    if qtype in K_QUANT_SCALES:
        plan, data = _k_quant_stream(cfg, qtype, seed)
        # The file-type key says ALL_F32, as K-quant random models always have (so their bytes and digests stay).
        write_streamed(path, cfg, tok, plan, data, quantized=False)
        return
    plan = [PlannedTensor(n, s, Q.F32 if qtype == Q.F32 or keeps_f32(n, s) else qtype) for n, s in expected_shapes(cfg).items()]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    bad = [t for t in plan if t.qtype != Q.F32 and t.shape[-1] % block]
    if bad:
        raise ModelFormatError(f"{qtype.name} needs row lengths that are multiples of {block}; {bad[0].name} has {bad[0].shape[-1]}")
    data = (pack_tensor(arr, t.qtype) for t, (_, arr) in zip(plan, _random_arrays(cfg, seed)))
    write_streamed(path, cfg, tok, plan, data, quantized=qtype != Q.F32)


def _k_quant_stream(cfg: ModelConfig, qtype: gguf.GGMLQuantizationType, seed: int) -> tuple[list[PlannedTensor], Iterator[np.ndarray]]:
    """A K-quant model's tensors in file order (the F32 ones first, then the packed ones, each in draw order) and
    their data, made one tensor at a time.

    Each packed tensor's blocks come from their own stream (``seed + 1``) scaled to the std of the float tensor the
    weight stream (``seed``) draws in its place; those floats are still drawn, since the F32 tensors after them in
    the weight stream (norms, routers) depend on them: that keeps every random model's bytes. Only the small F32
    tensors, the stds and fallback-typed tensors are kept until the blocks are written.
    """
    kept: dict[str, np.ndarray] = {}
    packed: list[tuple[PlannedTensor, float | np.ndarray]] = []  # the float tensor's std, or its fallback-type bytes
    for name, arr in _random_arrays(cfg, seed):
        if keeps_f32(name, arr.shape):
            kept[name] = arr
        elif arr.shape[-1] % K_BLOCK:  # as llama-quantize: a 32-block type (deepseek2's attn_k_b rows are qk_nope wide)
            packed.append((PlannedTensor(name, arr.shape, K_FALLBACK[qtype]), gguf.quants.quantize(arr, K_FALLBACK[qtype])))
        else:
            packed.append((PlannedTensor(name, arr.shape, qtype), float(arr.std())))
    plan = [PlannedTensor(name, arr.shape, Q.F32) for name, arr in kept.items()] + [t for t, _ in packed]

    def data() -> Iterator[np.ndarray]:
        yield from kept.values()
        rng = np.random.default_rng(seed + 1)
        for t, source in packed:
            yield source if isinstance(source, np.ndarray) else random_k_blocks(t.qtype, t.shape, source, rng)

    return plan, data()


def write_restating_mtp_model(path: str | Path, arch: str, *, n_embd: int = 32, n_ff_exp: int = 16, seed: int = 0) -> None:
    """A one-MoE-layer random *arch* model whose MTP block restates the trunk: it predicts what the trunk will, one token ahead.

    The block is a copy of layer 0 (attention, router, experts); eh_proj passes the normed embedding through and
    drops the hidden half; token embeddings have unit RMS, so enorm(embed(t)) is what layer 0 reads. The block's
    row for token t at position q is then layer 0's, and its head (the trunk's output norm and head) gives the
    trunk's logits for the token after t: a stand-in for a trained head, to test and measure MTP drafting with
    (with the halves of eh_proj swapped it would read the trunk's state instead and agree with nothing).
    """
    cfg = dataclasses.replace(random_config(arch, n_layer=2, n_embd=n_embd, n_ff_exp=n_ff_exp), n_layer=1, n_dense_lead=0, n_nextn=1)
    t = random_tensors(cfg, seed)
    e = t["token_embd.weight"]
    t["token_embd.weight"] = (e / np.sqrt(np.mean(e.astype(np.float64) ** 2, axis=1, keepdims=True))).astype(np.float32)
    for name in [n for n in t if n.startswith("blk.0.")]:
        t["blk.1." + name.removeprefix("blk.0.")] = t[name].copy()
    d = cfg.n_embd
    t["blk.1.nextn.eh_proj.weight"] = np.concatenate([np.eye(d), np.zeros((d, d))], axis=1).astype(np.float32)
    t["blk.1.nextn.enorm.weight"] = np.ones(d, dtype=np.float32)
    t["blk.1.nextn.hnorm.weight"] = np.ones(d, dtype=np.float32)
    write_model(path, cfg, t, byte_level_tokenizer())
