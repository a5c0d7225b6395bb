"""experts.kernels: batch invariance of every kernel and quant type, the fast kernel against the numpy
reference, kernel identity, the startup self-test (and its refusal of a kernel made to vary), the benchmark."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from experts.arch import Activation
from experts.bench_kernels import bench_kernels
from experts.errors import KernelError
from experts.gguf_model import GGUFModel, dequantize_bytes
from experts.kernels import QTYPES, ExpertBias, GgmlKernel, Kernel, KernelIdentity, QuantWeight, ReferenceKernel, self_test
from experts.kernels.ggml_kernel import FALLBACK
from experts.kernels.samples import random_expert_stack, random_weight
from experts.moe import OAI_LIMIT, SWIGLU, Glu, expert_ffn, tiled_matmul
from tests.conftest import make_model
from tests.doubles.kernels import VaryingKernel

OAI = Glu(Activation.SWIGLU_OAI, OAI_LIMIT)

Q = gguf.GGMLQuantizationType
D, N, FF, E = 256, 40, 256, 5  # row lengths are multiples of 256 so every K-quant fits
KERNELS = {"reference": ReferenceKernel, "ggml": GgmlKernel, "ggml-2threads": lambda: GgmlKernel(threads=2)}
# Per-row cosine of the fast kernel vs the F32 reference: ggml quantizes activations (Q8_K / Q8_0 / F16 / BF16).
MATMUL_COS = 0.9999
# The FFN quantizes activations twice in series (x, then silu(gate) * up): measured min ~0.9996 for K-quants.
FFN_COS = 0.999


@pytest.fixture(scope="module", params=list(KERNELS))
def kernel(request) -> Kernel:
    return KERNELS[request.param]()


@pytest.fixture(scope="module")
def ggml_kernel() -> GgmlKernel:
    return GgmlKernel()


def rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, D)) * rng.uniform(0.1, 10.0, size=(n, 1))).astype(np.float32)


def weight(qtype, shape=(N, D), seed=0) -> np.ndarray:
    return random_weight(qtype, shape, np.random.default_rng(seed))


def stacks(qtype, seed=0) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
    rng = np.random.default_rng(seed)
    return (
        QuantWeight(random_expert_stack(qtype, E, FF, D, rng), qtype, (E, FF, D)),
        QuantWeight(random_expert_stack(qtype, E, FF, D, rng), qtype, (E, FF, D)),
        QuantWeight(random_expert_stack(qtype, E, D, FF, rng), qtype, (E, D, FF)),
    )


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def assert_invariant(run, x: np.ndarray, aux: np.ndarray, seed: int = 0) -> None:
    """run(rows, aux rows) -> outputs; every row's bits must match its row of the full 17-row batch."""
    full = run(x, aux)
    for m in range(1, len(x) + 1):
        np.testing.assert_array_equal(bits(run(x[:m], aux[:m])), bits(full[:m]), err_msg=f"first {m} rows")
    rng = np.random.default_rng(seed)
    for _ in range(6):
        idx = rng.permutation(len(x))[: int(rng.integers(1, len(x) + 1))]
        np.testing.assert_array_equal(bits(run(x[idx], aux[idx])), bits(full[idx]), err_msg=f"rows {idx.tolist()}")
    # Row 3 among fresh random rows (of other magnitudes and experts) keeps its bits too.
    other = rows(9, seed + 100)
    other_aux = rng.permutation(np.resize(aux, 9))
    mixed = run(np.concatenate([other[:4], x[3:4], other[4:]]), np.concatenate([other_aux[:4], aux[3:4], other_aux[4:]]))
    np.testing.assert_array_equal(bits(mixed[4]), bits(full[3]), err_msg="row 3 among fresh rows")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ---- batch invariance -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_matmul_batch_invariant(kernel, qtype):
    """A matmul row's bits do not depend on batch size (1..17) or on which rows share the call."""
    w = weight(qtype)
    assert_invariant(lambda x, _: kernel.matmul(x, w, qtype, (N, D)), rows(17, 1), np.zeros(17))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_expert_ffn_batch_invariant(kernel, qtype):
    """An expert-FFN row's bits do not depend on batch size, neighbours or the experts other rows use."""
    gate, up, down = stacks(qtype)
    experts = np.random.default_rng(3).integers(0, E, size=17).astype(np.int32)
    assert_invariant(lambda x, ex: kernel.expert_ffn(x, ex, gate, up, down), rows(17, 2), experts)


def oai_biases(seed: int = 0) -> ExpertBias:
    """Biases wide enough that SwiGLU-OAI's clamps at +-7 bite on some rows (as the random gpt-oss models' do)."""
    rng = np.random.default_rng(seed)
    return ExpertBias(*(s * rng.standard_normal((E, n)).astype(np.float32) for s, n in ((3.0, FF), (3.0, FF), (1.0, D))))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.MXFP4], ids=lambda q: q.name)
def test_swiglu_oai_expert_ffn_with_biases_batch_invariant(kernel, qtype):
    """gpt-oss's experts (SwiGLU-OAI, per-expert biases): a row's bits do not depend on its batch either."""
    gate, up, down = stacks(qtype)
    experts = np.random.default_rng(3).integers(0, E, size=17).astype(np.int32)
    bias = oai_biases()
    assert_invariant(lambda x, ex: kernel.expert_ffn(x, ex, gate, up, down, OAI, bias), rows(17, 2), experts)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.MXFP4], ids=lambda q: q.name)
def test_swiglu_oai_with_biases_ggml_close_to_reference_and_reference_is_the_formula(ggml_kernel, qtype):
    """ggml's swiglu_oai + add_id agree with the numpy reference, whose bits are moe.expert_ffn with the biases;
    the clamps bite (some gate values exceed 7) and the biases matter."""
    gate, up, down = stacks(qtype)
    x = rows(17, 7)
    ex = np.random.default_rng(8).integers(0, E, size=17).astype(np.int32)
    bias = oai_biases()
    ref = ReferenceKernel().expert_ffn(x, ex, gate, up, down, OAI, bias)
    got = ggml_kernel.expert_ffn(x, ex, gate, up, down, OAI, bias)
    assert cosines(got, ref).min() >= (0.999999 if qtype == Q.F32 else FFN_COS)
    gate_max = -np.inf
    for e in np.unique(ex):
        sel = ex == e
        mats = [dequantize_bytes(s.data[e], qtype, s.shape[1:]) for s in (gate, up, down)]
        b = (bias.gate[e], bias.up[e], bias.down[e])
        np.testing.assert_array_equal(bits(ref[sel]), bits(expert_ffn(x[sel], *mats, OAI, b)))
        gate_max = max(gate_max, float((tiled_matmul(x[sel], mats[0].T) + b[0]).max()))
    assert gate_max > 7.0
    plain = ReferenceKernel().expert_ffn(x, ex, gate, up, down, OAI)
    assert cosines(plain, ref).max() < 0.99


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_clamped_swiglu_batch_invariant_ggml_close_to_reference_which_is_the_formula(kernel, ggml_kernel, qtype):
    """step35's clamped SwiGLU (up clipped to +-L, silu(gate) capped at L): each kernel batch invariant, ggml's clamp
    ops agree with the numpy reference, whose bits are moe.expert_ffn with the same Glu; the clamp changes the output."""
    gate, up, down = stacks(qtype)
    x = rows(17, 7)
    ex = np.random.default_rng(8).integers(0, E, size=17).astype(np.int32)
    clamped = Glu(Activation.SILU, 0.5)
    assert_invariant(lambda x, e: kernel.expert_ffn(x, e, gate, up, down, clamped), x, ex)
    ref = ReferenceKernel().expert_ffn(x, ex, gate, up, down, clamped)
    assert cosines(ggml_kernel.expert_ffn(x, ex, gate, up, down, clamped), ref).min() >= (0.999999 if qtype == Q.F32 else FFN_COS)
    for e in np.unique(ex):
        sel = ex == e
        mats = [dequantize_bytes(s.data[e], qtype, s.shape[1:]) for s in (gate, up, down)]
        np.testing.assert_array_equal(bits(ref[sel]), bits(expert_ffn(x[sel], *mats, clamped)))
    assert cosines(ReferenceKernel().expert_ffn(x, ex, gate, up, down), ref).max() < 0.99


def test_ggml_threads_do_not_change_bits(ggml_kernel):
    """The ggml kernel gives the same bits at 1 and 2 threads (so threads are not part of its identity)."""
    two = GgmlKernel(threads=2)
    for qtype in (Q.Q4_K, Q.Q8_0, Q.F32):
        w, x = weight(qtype), rows(17, 4)
        np.testing.assert_array_equal(bits(two.matmul(x, w, qtype, (N, D))), bits(ggml_kernel.matmul(x, w, qtype, (N, D))))
        gate, up, down = stacks(qtype)
        ex = np.arange(17, dtype=np.int32) % E
        np.testing.assert_array_equal(bits(two.expert_ffn(x, ex, gate, up, down)), bits(ggml_kernel.expert_ffn(x, ex, gate, up, down)))


# ---- numerics ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_reference_kernel_is_todays_path(qtype):
    """The reference kernel's bits are exactly today's numpy path: gguf-py dequantize + 8-row tiled matmul."""
    w, x = weight(qtype), rows(11, 5)
    dense = dequantize_bytes(w, qtype, (N, D))
    np.testing.assert_array_equal(bits(ReferenceKernel().matmul(x, w, qtype, (N, D))), bits(tiled_matmul(x, dense.T)))
    gate, up, down = stacks(qtype)
    ex = np.array([1, 3, 1, 0, 4, 4, 2, 1, 0, 3, 3], dtype=np.int32)
    got = ReferenceKernel().expert_ffn(x, ex, gate, up, down)
    for e in range(E):
        sel = ex == e
        mats = [dequantize_bytes(s.data[e], qtype, s.shape[1:]) for s in (gate, up, down)]
        np.testing.assert_array_equal(bits(got[sel]), bits(expert_ffn(x[sel], *mats)))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_ggml_matmul_close_to_reference(ggml_kernel, qtype):
    """ggml's matmul agrees with the F32 reference within the quantized-activation tolerance (per-row cosine)."""
    w, x = weight(qtype), rows(17, 6)
    got, ref = ggml_kernel.matmul(x, w, qtype, (N, D)), ReferenceKernel().matmul(x, w, qtype, (N, D))
    # ggml's F32 dot sums in its own SIMD order, so F32 weights are close (not bit-equal) to numpy's.
    assert cosines(got, ref).min() >= (0.999999 if qtype == Q.F32 else MATMUL_COS)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_ggml_expert_ffn_close_to_reference(ggml_kernel, qtype):
    """ggml's expert FFN (mul_mat_id + swiglu) agrees with the reference within the stated tolerance."""
    gate, up, down = stacks(qtype)
    x = rows(17, 7)
    ex = np.random.default_rng(8).integers(0, E, size=17).astype(np.int32)
    got, ref = ggml_kernel.expert_ffn(x, ex, gate, up, down), ReferenceKernel().expert_ffn(x, ex, gate, up, down)
    assert cosines(got, ref).min() >= (0.999999 if qtype == Q.F32 else FFN_COS)


def test_ggml_fused_gate_up_halves(ggml_kernel):
    """Gate and up given as the two halves of a fused gate_up stack (strided views) equal separate stacks."""
    rng = np.random.default_rng(9)
    fused = random_expert_stack(Q.Q4_K, E, 2 * FF, D, rng)
    half = fused.shape[1] // 2
    down = QuantWeight(random_expert_stack(Q.Q4_K, E, D, FF, rng), Q.Q4_K, (E, D, FF))
    x, ex = rows(6, 10), np.array([0, 4, 2, 2, 1, 3], dtype=np.int32)
    views = ggml_kernel.expert_ffn(x, ex, QuantWeight(fused[:, :half], Q.Q4_K, (E, FF, D)), QuantWeight(fused[:, half:], Q.Q4_K, (E, FF, D)), down)
    copies = ggml_kernel.expert_ffn(
        x, ex, QuantWeight(fused[:, :half].copy(), Q.Q4_K, (E, FF, D)), QuantWeight(fused[:, half:].copy(), Q.Q4_K, (E, FF, D)), down
    )
    np.testing.assert_array_equal(bits(views), bits(copies))


def test_ggml_falls_back_to_reference_for_other_types(ggml_kernel):
    """A type the ggml kernel does not run natively (IQ4_NL) is computed by the reference, and named in its identity."""
    assert "IQ4_NL" in ggml_kernel.identity.fallback and "fallback=" in str(ggml_kernel.identity)
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, size=(N * D // 32, 18), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)  # sane f16 block scales
    w, x = blocks.reshape(N, -1), rows(5, 12)
    np.testing.assert_array_equal(bits(ggml_kernel.matmul(x, w, Q.IQ4_NL, (N, D))), bits(ReferenceKernel().matmul(x, w, Q.IQ4_NL, (N, D))))
    assert set(FALLBACK).isdisjoint(q.name for q in QTYPES)


def test_ggml_reads_weights_from_the_memory_map(ggml_kernel, tmp_path):
    """A Q4_K model's expert and dense weights are used straight from GGUFModel's read-only memory map."""
    model = GGUFModel(make_model(tmp_path, "qwen3moe", Q.Q4_K, n_embd=256, n_ff_exp=256))
    raw = model.expert_bytes(0, "ffn_gate_exps", 1)
    assert not raw.flags.writeable and not raw.flags.owndata  # a view into the file, not a copy
    x = rows(3, 13)
    ref = ReferenceKernel().matmul(x, raw.reshape(256, -1), model.qtype("blk.0.ffn_gate_exps.weight"), (256, 256))
    got = ggml_kernel.matmul(x, raw.reshape(256, -1), model.qtype("blk.0.ffn_gate_exps.weight"), (256, 256))
    assert cosines(got, ref).min() >= MATMUL_COS
    name = "blk.0.attn_q.weight"
    shape = model.shape(name)
    dense = ggml_kernel.matmul(rows(2, 14)[:, : shape[1]], model.raw(name), model.qtype(name), shape)
    assert dense.shape == (2, shape[0]) and np.isfinite(dense).all()


# ---- identity ---------------------------------------------------------------------------------------------------


def test_identity_is_frozen_and_stable():
    """A kernel identity is an immutable value whose string names library, version, build and CPU features."""
    ident = GgmlKernel().identity
    assert str(ident) == str(GgmlKernel().identity) and ident == GgmlKernel().identity
    assert str(ident).startswith("ggml-python-0.0.45+ggml-") and "cpu=" in str(ident)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.version = "other"  # type: ignore[misc]
    assert str(KernelIdentity("numpy", "2.4")) == "numpy-2.4"
    assert isinstance(GgmlKernel(), Kernel) and isinstance(ReferenceKernel(), Kernel)


# ---- self-test --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [GgmlKernel, lambda: GgmlKernel(threads=2)], ids=["ggml", "ggml-2threads"])
def test_self_test_accepts_the_ggml_kernel(make):
    """The startup self-test passes for the ggml kernel, every quant type, at 1 and 2 threads."""
    self_test(make())


def test_self_test_accepts_the_reference_kernel():
    """The self-test passes for the reference kernel (three types: it dequantizes per call; all types are covered above)."""
    self_test(ReferenceKernel(), qtypes=(Q.F32, Q.Q8_0, Q.Q4_K))


@pytest.mark.parametrize("double", [VaryingKernel(batch=8), VaryingKernel(batch=17), VaryingKernel(neighbours=True)], ids=["batch8", "batch17", "neighbours"])
def test_self_test_refuses_a_varying_kernel(double):
    """A kernel whose rows change with batch size or neighbours is refused, with its identity in the error."""
    with pytest.raises(KernelError, match="varying-double-0.*not batch invariant"):
        self_test(double, qtypes=(Q.Q4_K,))


def test_self_test_refuses_variation_in_one_type_only():
    """A kernel that varies for one quant type only is still refused, and the error names the type."""

    class OneTypeVaries(VaryingKernel):
        def matmul(self, x, weight, qtype, shape):
            out = self.inner.matmul(x, weight, qtype, shape)
            return self._vary(out, x) if qtype == Q.Q6_K else out

        def expert_ffn(self, x, experts, gate, up, down, act=SWIGLU, bias=None):
            return self.inner.expert_ffn(x, experts, gate, up, down, act, bias)

    with pytest.raises(KernelError, match="Q6_K"):
        self_test(OneTypeVaries(batch=3), qtypes=(Q.Q8_0, Q.Q6_K))


# ---- benchmark --------------------------------------------------------------------------------------------------


def test_bench_kernels_reports_the_keys():
    """bench_kernels returns the expert-compute keys other tools read (a tiny config, one round; no timing check)."""
    result = bench_kernels(hidden=256, n_expert=16, top_k=2, ffn=256, rounds=1, reference_rounds=1, bandwidth_bytes=8 << 20)
    ec = result["expert_compute"]
    for key in ("kernel_1tok_ms", "kernel_8tok_ms_per_token", "floor_1tok_ms", "bandwidth_gbs", "reference_1tok_ms"):
        assert ec[key] > 0
    assert ec["kernel"].startswith("ggml-python") and result["config"]["threads"] == 1


# ---- experts served from the packed bytes ---------------------------------------------------------------------


def _routing(n: int, n_expert: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    held = rng.uniform(size=(n, k)) < 0.7
    return ids, w, held


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_packed_partial_sum_with_reference_is_todays_bits(tmp_path, arch):
    """Through the reference kernel, PackedExperts.partial_sum equals today's partial_sum over ExpertStore bit for bit."""
    from experts.moe import partial_sum
    from experts.packed_experts import PackedExperts
    from experts.slices import ExpertStore

    model = GGUFModel(make_model(tmp_path, arch, Q.Q4_K, n_embd=256, n_ff_exp=256))
    x = rows(7, 20)
    ids, w, held = _routing(7, model.cfg.n_expert, model.cfg.n_expert_used, 21)
    for layer in model.layers:
        want = partial_sum(ExpertStore(model), layer, x, ids, w, held)
        got = PackedExperts(model, ReferenceKernel()).partial_sum(layer, x, ids, w, held)
        np.testing.assert_array_equal(bits(got[0]), bits(want[0]))
        np.testing.assert_array_equal(got[1], want[1])


def test_packed_partial_sum_with_ggml_close_and_invariant(tmp_path, ggml_kernel):
    """Through ggml, packed partial sums are close to today's and a token's sum does not depend on the batch."""
    from experts.hosting import packed_bytes
    from experts.moe import partial_sum
    from experts.packed_experts import PackedExperts
    from experts.slices import ExpertStore

    model = GGUFModel(make_model(tmp_path, "qwen3moe", Q.Q4_K, n_embd=256, n_ff_exp=256))
    src = PackedExperts(model, ggml_kernel)
    assert packed_bytes(model, model.layers, model.experts) == sum(model.tensors[f"blk.{i}.{k}.weight"].n_bytes for i in model.layers for k in model.expert_kinds(i))
    x = rows(9, 22)
    ids, w, held = _routing(9, model.cfg.n_expert, model.cfg.n_expert_used, 23)
    held[:, 0] = True
    got, _ = src.partial_sum(1, x, ids, w, held)
    want, _ = partial_sum(ExpertStore(model), 1, x, ids, w, held)
    assert cosines(got, want).min() >= FFN_COS
    for t in range(9):
        alone, _ = src.partial_sum(1, x[t : t + 1], ids[t : t + 1], w[t : t + 1], held[t : t + 1])
        np.testing.assert_array_equal(bits(alone[0]), bits(got[t]))


def test_packed_experts_refuse_experts_not_hosted(tmp_path, ggml_kernel):
    """Asking a PackedExperts for an expert outside its range is a SliceError, not a wrong answer."""
    from experts.errors import SliceError
    from experts.gguf_model import ExpertRange
    from experts.packed_experts import PackedExperts

    model = GGUFModel(make_model(tmp_path, "qwen3moe", Q.Q8_0))
    src = PackedExperts(model, ggml_kernel, experts=ExpertRange(0, 4))
    with pytest.raises(SliceError):
        src.ffn(0, rows(1, 24)[:, : model.cfg.n_embd], np.array([5]))


# ---- choosing a kernel --------------------------------------------------------------------------------------------


def test_make_kernel_builds_and_self_tests():
    """make_kernel returns the named kernel with its thread count, self-tested; an unknown name is a KernelError."""
    from experts.kernels import make_kernel

    k = make_kernel("ggml", threads=2)
    assert isinstance(k, GgmlKernel) and k.threads == 2
    assert isinstance(make_kernel("reference", check=False), ReferenceKernel)
    with pytest.raises(KernelError, match="unknown kernel 'blas'"):
        make_kernel("blas")


def test_make_kernel_refuses_a_kernel_that_fails_its_self_test(monkeypatch):
    """A registered kernel that varies with the batch is refused at start-up by make_kernel."""
    from experts.kernels import choose

    monkeypatch.setitem(choose.KERNELS, "varying", lambda threads: VaryingKernel(batch=8))
    with pytest.raises(KernelError, match="varying-double"):
        choose.make_kernel("varying")


def test_ggml_rejects_weights_of_the_wrong_size(ggml_kernel):
    """A weight whose bytes do not match its shape is a ValueError, never a read past the buffer."""
    w = weight(Q.Q8_0)
    with pytest.raises(ValueError, match="bytes"):
        ggml_kernel.matmul(rows(1, 30), w[:-1], Q.Q8_0, (N, D))
    gate, up, down = stacks(Q.Q8_0)
    with pytest.raises(ValueError, match="expert stack"):
        ggml_kernel.expert_ffn(rows(1, 31), np.zeros(1, np.int32), QuantWeight(gate.data[:-1], Q.Q8_0, gate.shape), up, down)


def test_the_cli_offers_exactly_the_registered_kernels():
    """node.cli.options spells the names out (so --help loads no ggml); they must be KERNELS' names."""
    from experts.kernels import KERNELS
    from node.cli.options import KERNEL_NAMES

    assert sorted(KERNEL_NAMES) == sorted(KERNELS)


def test_a_kernel_is_shared_safely_by_threads(ggml_kernel):
    """Worker loop and pool thread (or forward and local experts) call one instance at once: same bits as alone."""
    from concurrent.futures import ThreadPoolExecutor

    w = weight(Q.Q4_K)
    xs = [rows(5, 40 + i) for i in range(8)]
    alone = [ggml_kernel.matmul(x, w, Q.Q4_K, (N, D)) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda x: ggml_kernel.matmul(x, w, Q.Q4_K, (N, D)), xs * 4))
    for i, y in enumerate(together):
        np.testing.assert_array_equal(y.view(np.uint32), alone[i % 8].view(np.uint32))
