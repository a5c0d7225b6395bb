"""Write a MoE model as GGUF the way llama.cpp's converter lays it out.

Used by the random-model generator, the embedded-model training script and the
slice writer, so every GGUF we make has one layout: tensor names and shapes
llama.cpp loads, stacked experts with the expert index outermost (ggml ne[2]).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .config import ModelConfig, TokenizerSpec
from .errors import ModelFormatError


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shapes (ggml ne reversed) of every tensor llama.cpp loads for *cfg* (optional ones included), in the
    order random models draw them: the arch's family module decides (:meth:`experts.archs.Arch.shapes`)."""
    return cfg.spec.shapes(cfg)


# Small tensors stay F32 whatever the requested type, as llama.cpp's converter does:
# norms, biases (the stacked expert biases too) and the router are tiny and precision-sensitive.
def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    # as llama-quantize: no conv1d weights (Kimi's ssm_conv1d_{q,k,v} too), nothing not ending in "weight" (Kimi's 2-D ssm_a)
    # minimax-m3's index branch too, as its converter forces (the block choice is sensitive to its scores' rounding)
    return len(shape) == 1 or "ssm_conv1d" in name or name.endswith((".bias", "ffn_gate_inp.weight", "ssm_a", "indexer.q_proj.weight", "indexer.k_proj.weight"))


def add_hparams(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The architecture keys llama.cpp reads (shared by full models and slices), as the arch's family module writes
    them (:meth:`experts.archs.Arch.add_hparams`)."""
    cfg.spec.add_hparams(w, cfg)


@dataclass(frozen=True)
class PlannedTensor:
    """What a GGUF header says about a tensor before its bytes exist: a writer streams the data after the header."""

    name: str
    shape: tuple[int, ...]  # numpy shape of the float tensor (ggml ne reversed)
    qtype: gguf.GGMLQuantizationType

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return gguf.quant_shape_to_byte_shape(self.shape, self.qtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape))


def write_model(
    path: str | Path,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    tokenizer: TokenizerSpec,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    extra_kv: Mapping[str, object] | None = None,
) -> None:
    """Write *tensors* (float arrays, numpy shapes) quantized to *qtype* where allowed.

    Each tensor is quantized as it is written, so the quantized copies never all exist at once.
    """
    plan = [PlannedTensor(name, arr.shape, gguf.GGMLQuantizationType.F32 if keeps_f32(name, arr.shape) else qtype) for name, arr in tensors.items()]
    write_streamed(path, cfg, tokenizer, plan, (pack_tensor(tensors[t.name], t.qtype) for t in plan), quantized=qtype != gguf.GGMLQuantizationType.F32, extra_kv=extra_kv)


def pack_tensor(arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """*arr* as :func:`write_streamed` takes it: float32, or quantized by gguf-py to *qtype*."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    return arr if qtype == gguf.GGMLQuantizationType.F32 else gguf.quantize(arr, qtype)


def write_streamed(
    path: str | Path,
    cfg: ModelConfig,
    tokenizer: TokenizerSpec,
    plan: Sequence[PlannedTensor],
    data: Iterable[np.ndarray],
    *,
    quantized: bool,
    extra_kv: Mapping[str, object] | None = None,
) -> None:
    """Write a GGUF whose tensors are *plan*, pulling each one's data from *data* only when it is written.

    Why: the header (KV data and every tensor's name, shape, type and offset) depends only on shapes, so it goes
    first and each tensor's bytes follow one at a time: a writer holds one tensor, not the file (a 30B-shaped random
    model is ~7x its file as float32). *data* yields, in plan order, float32 arrays for F32 entries and the packed
    data of the others (any dtype: gguf-py's quantize gives uint8 blocks, float16 for F16), checked by size. *quantized* picks the file-type key (ALL_F32 or GUESSED).
    """
    w = gguf.GGUFWriter(str(path), cfg.arch)
    add_hparams(w, cfg)
    w.add_file_type(gguf.LlamaFileType.GUESSED if quantized else gguf.LlamaFileType.ALL_F32)

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

    f32 = gguf.GGMLQuantizationType.F32
    for p in plan:
        if p.qtype == f32:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes)
        else:
            w.add_tensor_info(p.name, p.byte_shape, np.dtype(np.uint8), p.nbytes, raw_dtype=p.qtype)
    source = iter(data)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for p in plan:
            arr = next(source, None)
            if arr is None or arr.nbytes != p.nbytes or (p.qtype == f32 and arr.dtype != np.float32):
                got = "nothing" if arr is None else f"{arr.nbytes} bytes of {arr.dtype}"
                raise ModelFormatError(f"{p.name}: the header promised {p.nbytes} bytes of {p.qtype.name}, the data was {got}")
            w.write_tensor_data(np.ascontiguousarray(arr))
        if next(source, None) is not None:
            raise ModelFormatError(f"more tensor data than the {len(plan)} tensors the header lists")
    except BaseException:
        w.close()
        Path(path).unlink(missing_ok=True)  # a truncated file must not pass for a model (also on Ctrl-C)
        raise
    w.close()


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
