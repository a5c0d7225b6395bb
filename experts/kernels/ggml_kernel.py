"""The fast kernel: ggml's CPU matmuls (via ggml-python) run directly on the memory-mapped GGUF bytes.

Why ggml: it is llama.cpp's own tensor library, so it has hand-vectorised dot products for
every GGUF quant type, maintained with the format; measured here it is 10-20x the numpy path
(see ``experts.bench_kernels``). A weight becomes a ggml tensor whose data pointer is the
weight's address inside the file's memory map: nothing is copied or dequantized up front.

Numerics: ggml converts the float32 activations of each row to the weight's "vec_dot" type
(Q8_K for K-quants, Q8_0/Q8_1 for the 32-blocks, F16/BF16 for half weights) and takes integer
or half dot products, so results differ from the float32 reference by a quantized-activation
error (cosine ~0.99999) but are identical between machines with the same ``identity``.

Batch invariance: with this build (no llamafile sgemm, no repacked buffers: our tensors have no
ggml buffer, so ggml's "extra buffer" repacking never applies) every output element is one
``vec_dot`` over one weight row and one converted activation row, whichever thread runs it; the
startup self-test checks it anyway because other builds (ARM i8mm pairs rows) may differ.

One instance may be shared by threads (a worker computes on its event loop and on a pool thread, a
backbone's forward and its local experts run on different threads): each thread has its own work buffer.
ctypes releases the GIL during ``ggml_graph_compute``, so the threads do run at once.
"""

from __future__ import annotations

import ctypes
import os
import threading
from importlib.metadata import version
from typing import ClassVar

# libggml's threads are OpenMP's, and libgomp reads this once, when it is loaded (by ``import ggml``).
# Spinning waiters are a little faster on an idle machine but collapse when other processes share the
# cores (measured, 2 threads on a loaded 2-core machine: 39.6 ms per token with the default, 4.9 ms
# passive), and a volunteer's machine is rarely idle.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import ggml  # noqa: E402
import gguf  # noqa: E402
import numpy as np  # noqa: E402

from ..arch import Activation
from ..moe import OAI_ALPHA, SWIGLU, Glu
from .base import QTYPES, ExpertBias, QuantWeight
from .identity import KernelIdentity
from .reference import ReferenceKernel

Q = gguf.GGMLQuantizationType

# Types this kernel computes itself (all tested in tests/unit/test_kernels.py). Any other type
# gguf-py can read is computed by the numpy reference and named in the identity's ``fallback``.
NATIVE: frozenset[gguf.GGMLQuantizationType] = frozenset(QTYPES)
# The other types gguf-py 0.19 dequantizes; ggml has CPU kernels for them too, but they are
# not generated and tested here yet, so they run on the reference until they are.
FALLBACK: tuple[str, ...] = (
    "IQ1_M", "IQ1_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_S", "IQ3_XXS", "IQ4_NL", "IQ4_XS", "NVFP4", "TQ1_0", "TQ2_0",
)

_CPU_FEATURES = ("avx", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni", "fma", "f16c", "bmi2", "neon", "dotprod", "matmul_int8", "sve")


def _cpu_features() -> tuple[str, ...]:
    return tuple(f for f in _CPU_FEATURES if getattr(ggml, f"ggml_cpu_has_{f}", lambda: 0)())


def _build_flags() -> tuple[str, ...]:
    return ("llamafile" if ggml.ggml_cpu_has_llamafile() else "no-llamafile",)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data  # ~2.5x cheaper than __array_interface__, and it works on read-only memory maps


class GgmlKernel:
    """ggml CPU kernels; ``threads`` is the thread count of every ggml graph it runs."""

    dequantizes: ClassVar[bool] = False

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        ggml.ggml_cpu_init()
        self.threads = threads
        self.identity = KernelIdentity(
            library="ggml-python",
            version=f"{version('ggml-python')}+ggml-{ggml.ggml_version().decode()}",
            build=_build_flags(),
            cpu=_cpu_features(),
            fallback=FALLBACK,
        )
        self._reference = ReferenceKernel()
        self._local = threading.local()  # .work: this thread's ggml work buffer, grown on demand

    # ---- graph plumbing ---------------------------------------------------------------------

    def _context(self, n_tensors: int):
        size = n_tensors * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead() + 4096
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if ctx is None:
            raise MemoryError("ggml_init failed to allocate a context")
        return ctx

    @staticmethod
    def _bind(t, array: np.ndarray):
        """Point tensor *t* at *array*'s memory (the caller keeps *array* alive until compute ends)."""
        t.contents.data = _ptr(array)
        return t

    def _compute(self, ctx, out) -> None:
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, out)
        plan = ggml.ggml_graph_plan(graph, self.threads, None)
        work = getattr(self._local, "work", None)
        if work is None or plan.work_size > work.size:
            work = self._local.work = np.empty(plan.work_size, dtype=np.uint8)
        if plan.work_size:
            plan.work_data = ctypes.cast(_ptr(work), ctypes.POINTER(ctypes.c_uint8))
        status = ggml.ggml_graph_compute(graph, ctypes.byref(plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    # ---- Kernel ------------------------------------------------------------------------------

    def matmul(self, x: np.ndarray, weight: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
        if qtype not in NATIVE:
            return self._reference.matmul(x, weight, qtype, shape)
        n, k = shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        m = x.shape[0]
        if x.shape[1] != k:
            raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
        w = np.ascontiguousarray(weight).view(np.uint8)  # a no-op on a memory-mapped row-major weight
        need = n * gguf.quant_shape_to_byte_shape((k,), qtype)[0]
        if w.nbytes != need:  # ggml would read past the buffer
            raise ValueError(f"a {qtype.name} weight of shape {shape} has {need} bytes, got {w.nbytes}")
        out = np.empty((m, n), dtype=np.float32)
        if m == 0:
            return out
        ctx = self._context(4)
        try:
            tw = self._bind(ggml.ggml_new_tensor_2d(ctx, int(qtype), k, n), w)
            tx = self._bind(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, m), x)
            ty = self._bind(ggml.ggml_mul_mat(ctx, tw, tx), out)
            self._compute(ctx, ty)
        finally:
            ggml.ggml_free(ctx)
        return out

    def _stack(self, ctx, w: QuantWeight):
        n_expert, rows, cols = w.shape
        data = w.data
        if data.ndim != 2 or data.shape[0] != n_expert or data.strides[-1] != 1 or data.shape[-1] != rows * w.row_bytes:
            raise ValueError(f"expert stack of shape {w.shape} needs (n_expert, {rows * w.row_bytes}) bytes with contiguous experts")
        t = ggml.ggml_new_tensor_3d(ctx, int(w.qtype), cols, rows, n_expert)
        t.contents.nb[2] = data.strides[0]  # a fused gate_up half is a strided view into the file
        return self._bind(t, data)

    @staticmethod
    def _glu(ctx, act: Glu, yg, yu, bind):
        """The ops llama.cpp's graphs run for *act*: ggml's SwiGLU-OAI (gpt-oss), plain SwiGLU, or the clamped
        SwiGLU of build_moe_ffn / build_ffn (step35: up clamped to +-L, silu(gate) capped at L, multiplied).
        *bind* gives each op's result its (m, ff) buffer (our context allocates none)."""
        if act.act is Activation.SWIGLU_OAI:
            return bind(ggml.ggml_swiglu_oai(ctx, yg, yu, float(OAI_ALPHA), float(act.limit)))
        if not act.clamps:
            return bind(ggml.ggml_swiglu_split(ctx, yg, yu))
        up = bind(ggml.ggml_clamp(ctx, yu, -act.limit, act.limit))
        gate = bind(ggml.ggml_clamp(ctx, bind(ggml.ggml_silu(ctx, yg)), float("-inf"), act.limit))
        return bind(ggml.ggml_mul(ctx, gate, up))

    def expert_ffn(
        self, x: np.ndarray, experts: np.ndarray, gate: QuantWeight, up: QuantWeight, down: QuantWeight, act: Glu = SWIGLU, bias: ExpertBias | None = None
    ) -> np.ndarray:
        if not {gate.qtype, up.qtype, down.qtype} <= NATIVE:
            return self._reference.expert_ffn(x, experts, gate, up, down, act, bias)
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.ascontiguousarray(experts, dtype=np.int32)
        m, d = x.shape
        ff = gate.shape[1]
        out = np.empty((m, d), dtype=np.float32)
        if m == 0:
            return out
        if ids.shape != (m,) or ids.min() < 0 or ids.max() >= gate.shape[0]:
            raise ValueError(f"experts must be {m} indices in 0..{gate.shape[0] - 1}")
        keep = []  # every buffer a tensor points at, alive until compute ends

        def buf(*shape: int) -> np.ndarray:
            keep.append(np.empty(shape, dtype=np.float32))
            return keep[-1]

        ctx = self._context(24)
        try:
            tg, tu, td = self._stack(ctx, gate), self._stack(ctx, up), self._stack(ctx, down)
            tx = self._bind(ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, d, 1, m), x)
            tid = self._bind(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, 1, m), ids)

            def project(w, inp, b: np.ndarray | None, into: np.ndarray):
                """The stack's matmul of each row by its expert, + that expert's bias row (add_id: element-wise)."""
                t = self._bind(ggml.ggml_mul_mat_id(ctx, w, inp, tid), into if b is None else buf(*into.shape))
                if b is None:
                    return t
                keep.append(b := np.ascontiguousarray(b, dtype=np.float32))
                tb = self._bind(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, b.shape[1], b.shape[0]), b)
                return self._bind(ggml.ggml_add_id(ctx, t, tb, tid), into)

            yg = project(tg, tx, None if bias is None else bias.gate, buf(m, ff))
            yu = project(tu, tx, None if bias is None else bias.up, buf(m, ff))
            ya = self._glu(ctx, act, yg, yu, lambda t: self._bind(t, buf(m, ff)))
            y = project(td, ya, None if bias is None else bias.down, out)
            self._compute(ctx, y)
        finally:
            ggml.ggml_free(ctx)
        return out

