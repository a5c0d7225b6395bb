"""Write a MoE model as GGUF the way llama.cpp's converter lays it out.

Used by the random-model generator, the embedded-model training script and the
slice writer, so every GGUF we make has one layout: tensor names and shapes
llama.cpp loads, stacked experts with the expert index outermost (ggml ne[2]).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np

from .config import ModelConfig, TokenizerSpec


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shapes (ggml ne reversed) of every tensor llama.cpp loads for *cfg* (optional ones included), in the
    order random models draw them: the arch's family module decides (:meth:`experts.archs.Arch.shapes`)."""
    return cfg.spec.shapes(cfg)


# Small tensors stay F32 whatever the requested type, as llama.cpp's converter does:
# norms, biases (the stacked expert biases too) and the router are tiny and precision-sensitive.
def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or name.endswith((".bias", "ffn_gate_inp.weight", "ssm_conv1d.weight"))


def add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The architecture keys llama.cpp reads (shared by full models and slices), as the arch's family module writes
    them (:meth:`experts.archs.Arch.add_hparams`)."""
    cfg.spec.add_hparams(w, cfg)


def write_model(
    path: str | Path,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    tokenizer: TokenizerSpec,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    extra_kv: Mapping[str, object] | None = None,
    raw_tensors: Mapping[str, tuple[bytes | np.ndarray, tuple[int, ...], gguf.GGMLQuantizationType]] | None = None,
) -> None:
    """Write *tensors* (float arrays, numpy shapes) quantized to *qtype* where allowed.

    *raw_tensors* carries already-quantized bytes (name -> (data, numpy float shape,
    type)), which the slice writer uses to copy expert bytes without re-quantizing.
    """
    w = gguf.GGUFWriter(str(path), cfg.arch)
    add_hparams(w, cfg)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == gguf.GGMLQuantizationType.F32 else gguf.LlamaFileType.GUESSED)

    t = tokenizer
    w.add_tokenizer_model(t.model)
    w.add_tokenizer_pre(t.pre)
    w.add_token_list(t.tokens)
    w.add_token_types(t.token_types)
    if t.scores is not None:
        w.add_token_scores(t.scores)
    if t.merges is not None:
        w.add_token_merges(t.merges)
    if t.bos_id is not None:
        w.add_bos_token_id(t.bos_id)
    w.add_eos_token_id(t.eos_id)
    if t.unk_id is not None:
        w.add_unk_token_id(t.unk_id)
    if t.pad_id is not None:
        w.add_pad_token_id(t.pad_id)
    w.add_add_bos_token(t.add_bos)
    for key, value in {**t.extra, **(extra_kv or {})}.items():
        _add_kv(w, key, value)

    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F32 or keeps_f32(name, arr.shape):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quantize(arr, qtype), raw_dtype=qtype)
    for name, (data, shape, rtype) in (raw_tensors or {}).items():
        buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
        w.add_tensor(name, buf, raw_shape=_byte_shape(shape, rtype), raw_dtype=rtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _byte_shape(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> tuple[int, ...]:
    """gguf-py wants the byte shape of raw (uint8) tensor data: last dim in bytes."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * type_size)


def _add_kv(w: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"cannot store {type(value).__name__} under GGUF key {key}")
