"""What the tests of the two block-scaled FP8 kinds share -- Float8BlockScaling (128-blocks,
float32 scales: multi_block_cast_transpose, GroupedBlockFP8) and MXFP8 (32-blocks, E8M0 bytes:
multi_mxfp8_cast_transpose, GroupedMXFP8): the cast-transpose tests' runs against the reference,
the grouped GEMM tests' checks against an independent dequantization, and the benchmarks' peer
input. Each kind's own values (block shapes, token counts, scale modes, seeds) stay in its test
file and come in as arguments; each check here is a test's body, written once."""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from cugrouped import reference
from cugrouped.ops import grouped_gemm as gg
from cugrouped.ops.grouped_gemm import grouped_dgrad, grouped_fprop, grouped_wgrad
from test_grouped_gemm import (NP_DTYPE, OUT_DTYPES, _abs_sum, _assert_close, _to_np,
                               assert_correctly_rounded, rand)
from test_pad_cast_transpose import SPLITS, assert_buffers_equal, make_inputs

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}

# ------------------------------------------------------------------------------------------------
# The cast-transposes.

# The taxonomy plus cases at the 128-block edges: whole and partial blocks in both directions,
# k and m that are not multiples of 4 (the scale layouts' padding), an expert past one tile row.
BLOCK_SPLITS = dict(SPLITS, edges=([128, 129, 0, 255, 5], 130), wide=([3, 256, 40], 300))


@dataclasses.dataclass(frozen=True)
class CastKind:
    """One block-scaled cast: ``op`` its name in cugrouped and cugrouped.reference, ``seed_tag``
    what its case data's seeds are drawn from, ``result`` the class of its results."""

    op: str
    seed_tag: str
    result: type

    def cast(self, *args, **kw):
        return getattr(cugrouped, self.op)(*args, **kw)

    def reference(self, *args, **kw):
        return getattr(reference, self.op)(*args, **kw)

    def run_both(self, xs, m_splits, form, **kw):
        """(the CUDA kernel on the CPU emulator, the reference) for one input form: a list of
        experts, one tensor with host counts, or one tensor with device counts."""
        args = (xs, None) if form == "list" else (np.concatenate(xs, axis=0), list(m_splits))
        want = self.reference(*args, **kw)
        if form == "device":
            got = self.cast(args[0], np.array(m_splits, np.int64), splits_on_device=True,
                            backend="emulate", **kw)
            assert got.m_pad_splits is None
        else:
            got = self.cast(*args, backend="emulate", **kw)
        return got, want

    def case_data(self, split, dtype):
        m_splits, k = BLOCK_SPLITS[split]
        seed = zlib.crc32(repr((split, dtype, self.seed_tag)).encode())
        return m_splits, make_inputs(m_splits, k, dtype, seed, specials=split in ("skewed", "edges"))

    def to_host(self, res):
        """A result on the GPU copied to NumPy (CuPy arrays through cupy.asnumpy)."""
        import cupy

        return self.result(**{f: (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else v)
                              for f, v in vars(res).items()})


BLOCK_CAST = CastKind("multi_block_cast_transpose", "block", cugrouped.GroupedBlockFP8)
MXFP8_CAST = CastKind("multi_mxfp8_cast_transpose", "mx", cugrouped.GroupedMXFP8)


def permuted(tokens, idx):
    """The rows a framework's index_select would give, a negative index a zero row."""
    zero = np.zeros((1, tokens.shape[1]), tokens.dtype)
    return np.concatenate([tokens, zero])[np.where(idx >= 0, idx, tokens.shape[0])]


def assert_same_bits(got, want, label=""):
    """Bit for bit; with device splits every buffer but ``data`` and ``column_sums`` is sized for
    the worst case."""
    assert_buffers_equal(got, want, ("data", "data_t", "scale_inv", "scale_inv_t", "column_sums"),
                         ("data_t", "scale_inv", "scale_inv_t"), label)


def check_emulated_kernel(kind, split, dtype, form, order, label, **kw):
    """The emulated kernel's bits are the reference's, in the given fiber order, and the
    transposed copy's padding columns are zeros."""
    m_splits, xs = kind.case_data(split, dtype)
    with cugrouped.emulation_order(order):
        got, want = kind.run_both(xs, m_splits, form, **kw)
    assert_same_bits(got, want, label)
    for i, m in enumerate(m_splits):
        assert not np.asarray(got.columnwise(i))[:, m:].any()


def check_one_sided_copy(kind, xs, m_splits, which, label, **kw):
    """Only the row-wise or only the column-wise copy: the reference's bits, the other None."""
    got, want = kind.run_both(xs, m_splits, "tensor", rowwise=which == "rowwise",
                              columnwise=which == "columnwise", **kw)
    assert_same_bits(got, want, label)
    assert (got.data is None) == (which == "columnwise") and (got.data_t is None) == (which == "rowwise")


def check_over_several_chunks(kind, seeds, k, kernel_has="", **kw):
    """150 experts (some empty): three launches of 64-expert chunks, host and device counts."""
    rng = np.random.default_rng(seeds[0])
    m_splits = [int(v) for v in rng.integers(0, 140, size=150)]
    m_splits[70:75] = [0] * 5
    xs = make_inputs(m_splits, k, "float16", seed=seeds[1])
    for form, order in (("list", "forward"), ("device", "warps")):   # "warps": a warp runs ahead
        with cugrouped.record_launches() as launches, cugrouped.emulation_order(order):
            got, want = kind.run_both(xs, m_splits, form, **kw)
        assert_same_bits(got, want, form)
        assert len(launches) == 3 and all(kernel_has in x.kernel for x in launches), form


def check_gather(kind, seed_key, dtype, form, label, **kw):
    """The fused permute (row_index, some rows -1) equals casting the permuted copy; returns
    (tokens, m_splits, idx, the reference's result) for further checks."""
    rng = np.random.default_rng(zlib.crc32(repr(seed_key).encode()))
    tokens = make_inputs([300], 200, dtype, seed=int(rng.integers(1 << 30)))[0]
    m_splits = [130, 0, 8, 262]
    idx = rng.integers(-3, 300, sum(m_splits)).astype(np.int64)      # some zero rows
    splits = m_splits if form == "host" else np.array(m_splits, np.int64)
    got = kind.cast(tokens, splits, row_index=idx, backend="emulate",
                    splits_on_device=form == "device", **kw)
    want = kind.reference(permuted(tokens, idx), m_splits, **kw)
    assert_same_bits(got, want, label)
    return tokens, m_splits, idx, want


def check_torch_tensors_in_and_out(kind, scale_dtype):
    """torch tensors in (bfloat16 input, list or tensor counts) give torch tensors out with the
    reference's bits, from both CPU backends; returns the results."""
    import torch

    x = torch.randn(300, 136, dtype=torch.bfloat16)
    want = kind.reference(x.view(torch.int16).numpy().view(np.uint16), [100, 0, 200],
                          dtype="bfloat16")
    results = []
    for backend, splits in itertools.product(("reference", "emulate"),
                                             ([100, 0, 200], torch.tensor([100, 0, 200]))):
        got = kind.cast(x, splits, backend=backend)
        assert got.data.dtype == torch.float8_e4m3fn and got.scale_inv.dtype == scale_dtype
        host = kind.result(**{f: (v.view(torch.uint8).numpy() if f == "data" else
                                  v.numpy() if isinstance(v, torch.Tensor) else v)
                              for f, v in vars(got).items()})
        assert_same_bits(host, want, f"torch {backend}")
        results.append(got)
    return results


def check_bad_out_buffer_is_rejected(kind, x, backend, field, bad):
    """An ``out`` whose ``field`` is replaced by ``bad(field)`` is refused naming it, and the
    other buffers are left as they were."""
    out = kind.cast(x, [len(x)], backend="emulate")
    setattr(out, field, bad(getattr(out, field)))
    before = {n: np.array(getattr(out, n)) for n in ("data", "data_t", "scale_inv", "scale_inv_t")
              if n != field}
    with pytest.raises(ValueError, match=rf"out\.{field}"):
        kind.cast(x * 3, [len(x)], out=out, backend=backend)
    for n, b in before.items():
        assert np.array_equal(np.asarray(getattr(out, n)).view(np.uint8), b.view(np.uint8)), n


def check_cuda_matches_reference(kind, split, dtype, form, label, **kw):
    """The CUDA kernel's bits are the reference's (bfloat16 input through its uint16 bits)."""
    import cupy

    m_splits, xs = kind.case_data(split, dtype)
    carrier = {"bfloat16": np.uint16}.get(dtype)
    dxs = [cupy.asarray(x.view(carrier) if carrier else x) for x in xs]
    splits = None
    if form == "device":
        dxs, splits = cupy.concatenate(dxs, axis=0), cupy.asarray(np.array(m_splits, np.int64))
    want = kind.reference(xs, **kw)
    got = kind.cast(dxs, splits, dtype=dtype if carrier else None, **kw)
    assert_same_bits(kind.to_host(got), want, label)


def check_cuda_gather(kind, seeds, dtype, form, label, **kw):
    """The CUDA gather over 80 experts (two launches) against the reference's permuted cast."""
    import cupy

    rng = np.random.default_rng(seeds[0])
    tokens = make_inputs([300], 256, dtype, seed=seeds[1])[0]
    m_splits = [136, 0, 8, 264] * 20                       # 80 experts: two launches
    idx = rng.integers(-3, 300, sum(m_splits)).astype(np.int64)
    splits = m_splits if form == "host" else cupy.asarray(np.array(m_splits, np.int64))
    got = kind.cast(cupy.asarray(tokens), splits, row_index=cupy.asarray(idx), **kw)
    want = kind.reference(permuted(tokens, idx), m_splits, **kw)
    assert_same_bits(kind.to_host(got), want, label)


# ------------------------------------------------------------------------------------------------
# The grouped GEMMs. ``independent(op, copy)`` is each kind's own float64 dequantization of the
# per-expert matrices, (m_i, k) for either copy.

def random_gemm_inputs(m_splits, k, n, seed, xp=np):
    """Per expert float32 x (m_i, k), w (n, k) and dy (m_i, n), every row scaled by its own
    factor in 2^-6..2^6 (so the blocks' scales differ)."""
    rng = np.random.default_rng(seed)
    amp = lambda m: np.exp2(rng.uniform(-6, 6, (m, 1))).astype(np.float32)  # noqa: E731
    xs = [xp.asarray(rand(rng, (m, k)) * amp(m)) for m in m_splits]
    ws = [xp.asarray(rand(rng, (n, k), 0.05) * amp(n)) for _ in m_splits]
    dys = [xp.asarray(rand(rng, (m, n), 1e-3) * amp(m)) for m in m_splits]
    return xs, ws, dys


def check_wgrad_reads_the_transposed_copies(X, DY, independent):
    xts, dyts = independent(X, "columnwise"), independent(DY, "columnwise")
    dw = grouped_wgrad(X, DY)
    assert_correctly_rounded(dw, np.stack([d.T @ a for a, d in zip(xts, dyts)]), "float32")


def check_reference_passes(X, W, DY, independent):
    """Each pass of the reference is its exact float64 product correctly rounded: fprop x w^T of
    the row-wise copies (every output dtype), dgrad dy w with w's transposed copy, wgrad dy^T x
    of the transposed copies."""
    xs, ws, dys = independent(X, "rowwise"), independent(W, "rowwise"), independent(DY, "rowwise")
    for out_dtype in OUT_DTYPES:
        y = grouped_fprop(X, W, out_dtype=out_dtype)
        assert_correctly_rounded(y, np.concatenate([a @ b.T for a, b in zip(xs, ws)]), out_dtype)
    wts = independent(W, "columnwise")
    dx = grouped_dgrad(DY, W, out_dtype="float32")
    assert_correctly_rounded(dx, np.concatenate([a @ b for a, b in zip(dys, wts)]), "float32")
    check_wgrad_reads_the_transposed_copies(X, DY, independent)


def check_copies_differ_and_wgrad_reads_the_transposed(X, DY, independent):
    """The transposed copies are quantized along the tokens, so they differ from the row-wise
    ones; wgrad's result is the transposed copies' product."""
    xs, xts = independent(X, "rowwise"), independent(X, "columnwise")
    assert any(not np.array_equal(a, b) for a, b in zip(xs, xts))
    check_wgrad_reads_the_transposed_copies(X, DY, independent)


def check_reference_bias_and_accumulate(X, W, DY, independent):
    """fprop with a bfloat16 bias, and wgrad accumulated into main grads of 0.5 (an expert
    without tokens keeps its gradient)."""
    E, n, k = X.num_experts, DY.k, X.k
    bias = np.random.default_rng(0).standard_normal((E, n)).astype(ml_dtypes.bfloat16)
    xs, ws = independent(X, "rowwise"), independent(W, "rowwise")
    y = grouped_fprop(X, W, bias, out_dtype="bfloat16")
    exact = np.concatenate([a @ b.T + bias[i].astype(np.float64)
                            for i, (a, b) in enumerate(zip(xs, ws))])
    assert_correctly_rounded(y, exact, "bfloat16")
    main = [np.full((n, k), 0.5, np.float32) for _ in range(E)]
    grouped_wgrad(X, DY, out=main, accumulate=True)
    xts, dyts = independent(X, "columnwise"), independent(DY, "columnwise")
    for i, (a, d) in enumerate(zip(xts, dyts)):
        if a.shape[0]:
            assert_correctly_rounded(main[i], d.T @ a + 0.5, "float32")
        else:
            assert np.all(main[i] == 0.5)


def check_descriptors_accept(X, W, DY, pass_name, out_dtype, compute_capability, modes, **also):
    """Every attribute the op sets for the pass is accepted by the real libcublasLt with its size
    and value (descriptors need no GPU); the scale modes are ``modes`` (A, B) and the attributes
    in ``also`` have their given values."""
    from cugrouped import cublaslt
    from cugrouped.cublaslt import descriptors as D

    try:
        cublaslt.lib()
    except OSError as exc:  # pragma: no cover - the test environment installs nvidia-cublas
        pytest.skip(f"libcublasLt not installed: {exc}")
    bias = np.zeros((X.num_experts, DY.k), NP_DTYPE[gg.bias_dtype_for(out_dtype, True)])
    problem = {"fprop": lambda: gg.check_fprop(X, W, bias, out_dtype=out_dtype),
               "dgrad": lambda: gg.check_dgrad(DY, W, out_dtype=out_dtype),
               "wgrad": lambda: gg.check_wgrad(X, DY, out_dtype=out_dtype)}[pass_name]()
    _, blocks = gg.outputs(problem, None, np)
    plan = gg.plan_problem(problem, blocks)
    ws = gg.workspace_bytes_for(compute_capability)
    for call in plan.calls:
        desc, *_ = gg.build_descriptors(plan.config, call, ws)
        for name, value in plan.config.attributes().items():
            assert desc.get(name) == value, name
        assert (desc.get("A_SCALE_MODE"), desc.get("B_SCALE_MODE")) == modes
        for name, value in also.items():
            assert desc.get(name) == value, name
        assert desc.get("A_SCALE_POINTER") == call.a_scale_ptr != 0
        assert desc.get("B_SCALE_POINTER") == call.b_scale_ptr != 0
    D.clear_caches()


def check_host_loop_sets_every_experts_scales(X, W, compute_capability, calls, refuse, match):
    """The launch loop of fprop(X, W) with only the device calls faked (cuBLAS 13.0 on the given
    compute capability): ``calls`` launches, each expert's descriptor with its own scale
    pointers; then a state with the attributes in ``refuse`` refuses before calling anything."""
    from cugrouped.bench.gemm import host_loop_state
    from cugrouped.cublaslt import descriptors as D

    st = host_loop_state()
    seen = []
    st.matmul = lambda *args: seen.append(args) or 0
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    vp = gg.plan_arrays(p, blocks)
    st.cublas_version, st.compute_capability = 130000, compute_capability
    gg._launch_plan(vp, p, blocks, st)
    assert len(seen) == calls
    for c in vp.calls():
        desc = D.expert_desc(vp.config, c.expert)
        assert (desc.get("A_SCALE_POINTER"), desc.get("B_SCALE_POINTER")) == (c.a_scale_ptr, c.b_scale_ptr)
        assert c.b_scale_ptr == p.left_scale[c.expert]
    for name, value in refuse.items():
        setattr(st, name, value)
    with pytest.raises(RuntimeError, match=match):
        gg._launch_plan(vp, p, blocks, st)
    assert len(seen) == calls
    D.clear_caches()


def check_memo_keys_by_buffers(X, W, same):
    """The per-call memo: fprop(same, W) after fprop(X, W) is a hit (the stored check), X with a
    copy of its scale buffer a miss. Returns the first and the missed check."""
    def checked(x):
        return gg.checked("fprop", (x, W, None), dict(out_dtype=None, fast_accum=True))

    first = checked(X)
    assert checked(same).problem is first.problem
    other = checked(dataclasses.replace(X, scale_inv=np.asarray(X.scale_inv).copy()))
    assert other.problem is not first.problem
    return first, other


def skip_unless_block_gemms(mx=False):
    """Block-scaled GEMMs run on Hopper with cuBLAS 12.9+ only, MXFP8 ones (``mx``) on sm_100+
    with cuBLAS 12.8+: elsewhere their GPU tests skip with the library's own reason (the casts
    run on any GPU)."""
    import cupy

    from cugrouped.cublaslt import version

    reason = gg.block_scaling_unsupported(version(), int(cupy.cuda.Device().compute_capability),
                                          mx=mx)
    if reason:
        pytest.skip(reason)


def host_operand(g):
    """A GEMM operand on the GPU copied to NumPy (its FP8 bytes viewed as ml_dtypes FP8)."""
    import cupy

    get = lambda a: None if a is None else cupy.asnumpy(a)  # noqa: E731
    data = get(g.data)
    return dataclasses.replace(g, data=None if data is None else data.view(FP8[g.fp8_format][0]),
                               data_t=get(g.data_t), scale_inv=get(g.scale_inv),
                               scale_inv_t=get(g.scale_inv_t))


# The block-scaled GEMMs' accumulation bound, relative to sum |a b|. On an H200 (cuBLASLt 13.1,
# 2026-12-04) their error passed the old bound (2^-11 of it plus the output roundings) by up to
# 1.34x in these tests, and scripts/gpu_probe_gemm.py measured up to 2.4 x 2^-11 (wgrad, k up to
# 4096): more than a rounded 14-bit partial sum per 32-deep tensor-core step would give. Hopper's FP8 accumulator aligns a step's addends (32
# products and the partial sum) to the largest and truncates each to about 13 fraction bits, so a
# step can lose up to its addend count times 2^-13 of its largest term, and promotion to fp32
# only comes at each 128-element block's end. Fast accumulation's bound (2^-9, test_grouped_gemm)
# covers the measured error 1.7 times over.
BLOCK_ACC_EPS = 2**-9


def check_gpu_passes_vs_reference(X, W, DY, independent):
    """cuBLASLt's fprop and dgrad (every output dtype) and wgrad against the reference on host
    copies, within BLOCK_ACC_EPS of sum |a b| (from ``independent``) plus the output roundings."""
    import cupy

    hX, hW, hDY = host_operand(X), host_operand(W), host_operand(DY)
    xs, ws, dys = independent(hX, "rowwise"), independent(hW, "rowwise"), independent(hDY, "rowwise")
    for out_dtype in OUT_DTYPES:
        y = grouped_fprop(X, W, out_dtype=out_dtype)
        _assert_close(_to_np(y, out_dtype), grouped_fprop(hX, hW, out_dtype=out_dtype),
                      _abs_sum(xs, ws, "fprop"), out_dtype, BLOCK_ACC_EPS)
        dx = grouped_dgrad(DY, W, out_dtype=out_dtype)
        _assert_close(_to_np(dx, out_dtype), grouped_dgrad(hDY, hW, out_dtype=out_dtype),
                      _abs_sum(dys, independent(hW, "columnwise"), "dgrad"), out_dtype,
                      BLOCK_ACC_EPS)
    dw = grouped_wgrad(X, DY)
    xts, dyts = independent(hX, "columnwise"), independent(hDY, "columnwise")
    _assert_close(cupy.asnumpy(dw), grouped_wgrad(hX, hDY), _abs_sum(dyts, xts, "wgrad"),
                  "float32", BLOCK_ACC_EPS)


# ------------------------------------------------------------------------------------------------
# The benchmarks' torch eager peers.

def bench_peer_case(kind, fmt, seed):
    """The peers' input, bfloat16 (208, 256) for experts [48, 0, 160, 16] with every row scaled
    by its own power of two and row 5 all zero (all-zero blocks), and the op's result on it:
    (m_splits, x, the reference's result)."""
    import torch

    m_splits, k = [48, 0, 160, 16], 256
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((sum(m_splits), k), generator=g)
         * torch.exp2(torch.randint(-12, 12, (sum(m_splits), 1), generator=g).float())).to(torch.bfloat16)
    x[5, :] = 0
    want = kind.reference(x.view(torch.int16).numpy().view(np.uint16), m_splits, dtype="bfloat16",
                          fp8_format=fmt)
    return m_splits, x, want
