"""Grouped GEMMs (fprop, dgrad, wgrad): planning as pure functions, descriptors built for every pass
and dtype combination against the real libcublasLt, the NumPy reference against an independent
float64 computation over the split taxonomy (design.md §6), argument checks, and (marked ``gpu``)
the cuBLASLt path against the reference."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pytest

import cugrouped
from cugrouped.cublaslt import _enums as E
from cugrouped.ops import _launch
from cugrouped.ops import grouped_gemm as gg
from cugrouped.ops.grouped_gemm import grouped_dgrad, grouped_fprop, grouped_wgrad

# name -> (m_splits, k, n); k, n multiples of 16 (FP8); token counts free.
SPLITS = {
    "uniform": ([32, 32, 32, 32], 64, 48),
    "skewed": ([3, 130, 1, 70], 96, 32),
    "empty_first": ([0, 33, 17], 64, 32),
    "empty_middle": ([20, 0, 45], 48, 64),
    "empty_last": ([29, 64, 0], 32, 48),
    "single": ([77], 144, 16),
    "not_mult16": ([17, 5, 31, 9], 32, 32),
    "count_one": ([1, 1, 2], 64, 32),
    "k_smallest": ([19, 40], 16, 16),
}
PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]
OUT_DTYPES = ("bfloat16", "float16", "float32")
NP_DTYPE = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
MANT_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
MIN_EXP = {"bfloat16": -126, "float16": -14, "float32": -126}


def rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


NO_GROUPED_LIB = ("this libcublasLt has no grouped GEMM (cuBLAS 13.2+; torch 2.11's CUDA wheels "
                  "bring 13.1): the grouped descriptors cannot be made")


def make_fp8(m_splits, k, n, seed, x_fmt="e4m3", w_fmt="e4m3", g_fmt="e5m2", xp=np):
    """x (m_i, k), w (n, k), dy (m_i, n) cast with multi_pad_cast_transpose (on xp's device)."""
    rng = np.random.default_rng(seed)
    xs = [xp.asarray(rand(rng, (m, k))) for m in m_splits]
    ws = [xp.asarray(rand(rng, (n, k), 0.05)) for _ in m_splits]
    dys = [xp.asarray(rand(rng, (m, n), 1e-3)) for m in m_splits]
    X = cugrouped.multi_pad_cast_transpose(xs, fp8_format=x_fmt)
    W = cugrouped.multi_pad_cast_transpose(ws, fp8_format=w_fmt, align=1)
    DY = cugrouped.multi_pad_cast_transpose(dys, fp8_format=g_fmt)
    return X, W, DY


def independent(op, copy):
    """float64 matrices straight from ml_dtypes' FP8 -> float64 cast (not the reference's path)."""
    if not isinstance(op, cugrouped.GroupedFP8):
        return [np.asarray(a).astype(np.float64) for a in op]
    dt = ml_dtypes.float8_e4m3fn if op.fp8_format == "e4m3" else ml_dtypes.float8_e5m2
    out = []
    for i, m in enumerate(op.m_splits):
        if copy == "rowwise":
            q = np.asarray(op.data).view(np.uint8)[sum(op.m_splits[:i]):sum(op.m_splits[:i + 1])]
        else:
            start = sum(mp * op.k for mp in op.m_pad_splits[:i])
            q = np.asarray(op.data_t)[start:start + op.k * op.m_pad_splits[i]].reshape(
                op.k, op.m_pad_splits[i])[:, :m].T
        out.append(q.view(dt).astype(np.float64) * float(np.asarray(op.scale_inv)[i]))
    return out


def half_ulp(exact, out_dtype):
    """Half a unit in the last place of ``out_dtype`` at each exact value (subnormals included)."""
    a = np.maximum(np.abs(exact), np.finfo(np.float64).tiny)
    e = np.maximum(np.floor(np.log2(a)), MIN_EXP[out_dtype])
    return 0.5 * np.exp2(e - MANT_BITS[out_dtype])


def assert_correctly_rounded(got, exact, out_dtype):
    """The reference must be ``exact`` rounded once to ``out_dtype``: within half an ulp."""
    g = np.asarray(got).astype(np.float64)
    assert g.shape == exact.shape
    err = np.abs(g - exact)
    bound = half_ulp(exact, out_dtype) * (1 + 1e-6) + 1e-300
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound)}"


# ---------------------------------------------------------------------------------------------
# The reference against an independent float64 computation.

@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(p))
def test_reference_fp8_fprop_dgrad_wgrad(split, pair):
    m_splits, k, n = SPLITS[split]
    # fprop pairs (w, x), dgrad (w, dy), wgrad (x, dy): pick formats so each pair is legal
    w_fmt, x_fmt = pair
    X, W, DY = make_fp8(m_splits, k, n, seed=len(split), x_fmt=x_fmt, w_fmt=w_fmt,
                        g_fmt="e4m3" if "e5m2" in (x_fmt, w_fmt) else "e5m2")
    xs, ws = independent(X, "rowwise"), independent(W, "rowwise")
    dys = independent(DY, "rowwise")
    for out_dtype in OUT_DTYPES:
        y = grouped_fprop(X, W, out_dtype=out_dtype)
        exact = np.concatenate([x @ w.T for x, w in zip(xs, ws)])
        assert np.asarray(y).dtype == NP_DTYPE[out_dtype]
        assert_correctly_rounded(y, exact, out_dtype)
        dx = grouped_dgrad(DY, W, out_dtype=out_dtype)
        assert_correctly_rounded(dx, np.concatenate([d @ w for d, w in zip(dys, ws)]), out_dtype)
    dw = grouped_wgrad(X, DY)
    assert dw.shape == (len(m_splits), n, k) and dw.dtype == np.float32
    assert_correctly_rounded(dw, np.stack([d.T @ x for d, x in zip(dys, xs)]), "float32")
    for i, m in enumerate(m_splits):
        if m == 0:
            assert not np.any(dw[i]), "an empty expert's weight gradient is zero"


def test_reference_uses_the_transposed_copies_where_the_table_says():
    """dgrad reads w's transposed copy, wgrad both transposed copies: dropping the row-wise copies
    changes nothing; dropping the transposed ones is refused with a clear error."""
    X, W, DY = make_fp8([5, 19], 32, 16, seed=3)
    dx = grouped_dgrad(DY, W)
    dw = grouped_wgrad(X, DY)
    no_rows = lambda g: dataclasses.replace(g, data=None)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(grouped_dgrad(DY, dataclasses.replace(W, data=None))), dx)
    np.testing.assert_array_equal(grouped_wgrad(no_rows(X), no_rows(DY)), dw)
    with pytest.raises(ValueError, match="w: dgrad .* needs the columnwise FP8 copy"):
        grouped_dgrad(DY, dataclasses.replace(W, data_t=None))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_reference_bias(out_dtype):
    m_splits, k, n = [7, 0, 21], 32, 48
    X, W, _ = make_fp8(m_splits, k, n, seed=5)
    bdt = gg.bias_dtype_for(out_dtype, fp8=True)
    bias = np.random.default_rng(1).standard_normal((3, n)).astype(NP_DTYPE[bdt])
    y = grouped_fprop(X, W, bias, out_dtype=out_dtype)
    xs, ws = independent(X, "rowwise"), independent(W, "rowwise")
    exact = np.concatenate([x @ w.T + bias[i].astype(np.float64) for i, (x, w) in enumerate(zip(xs, ws))])
    assert_correctly_rounded(y, exact, out_dtype)
    y2 = grouped_fprop(X, W, list(bias), out_dtype=out_dtype)  # list form
    np.testing.assert_array_equal(np.asarray(y2).view(np.uint8), np.asarray(y).view(np.uint8))


def test_reference_wgrad_accumulate_and_empty_experts():
    m_splits, k, n = [0, 33, 0, 16], 32, 16
    X, _, DY = make_fp8(m_splits, k, n, seed=9)
    rng = np.random.default_rng(2)
    main_grad = [rand(rng, (n, k)) for _ in m_splits]
    before = [g.copy() for g in main_grad]
    res = grouped_wgrad(X, DY, out=main_grad, accumulate=True)
    assert res is main_grad
    xs, dys = independent(X, "columnwise"), independent(DY, "columnwise")
    for i, m in enumerate(m_splits):
        if m == 0:
            np.testing.assert_array_equal(main_grad[i], before[i])  # untouched
        else:
            assert_correctly_rounded(main_grad[i], before[i].astype(np.float64) + dys[i].T @ xs[i],
                                     "float32")
    # not accumulating into a given buffer: overwritten, empty experts zeroed
    out = np.full((4, n, k), 7.0, np.float32)
    grouped_wgrad(X, DY, out=out)
    assert not out[0].any() and not out[2].any()
    assert_correctly_rounded(out[1], dys[1].T @ xs[1], "float32")


@pytest.mark.parametrize("split", ["skewed", "empty_middle", "single", "count_one"])
@pytest.mark.parametrize("dtype,out_dtype", [("bfloat16", "bfloat16"), ("bfloat16", "float32"),
                                             ("float16", "float16"), ("float32", "float32")])
def test_reference_plain(split, dtype, out_dtype):
    m_splits, k, n = SPLITS[split]
    k, n = k + 3, n + 5  # plain GEMMs take any sizes
    rng = np.random.default_rng(11)
    xs = [rand(rng, (m, k)).astype(NP_DTYPE[dtype]) for m in m_splits]
    ws = [rand(rng, (n, k), 0.1).astype(NP_DTYPE[dtype]) for _ in m_splits]
    dys = [rand(rng, (m, n)).astype(NP_DTYPE[dtype]) for m in m_splits]
    f = lambda a: [np.asarray(v).astype(np.float64) for v in a]  # noqa: E731
    y = grouped_fprop(xs, ws, out_dtype=out_dtype)
    assert_correctly_rounded(y, np.concatenate([x @ w.T for x, w in zip(f(xs), f(ws))]), out_dtype)
    y3 = grouped_fprop(xs, np.stack(ws), out_dtype=out_dtype)  # (E, n, k) weights
    np.testing.assert_array_equal(np.asarray(y3).view(np.uint8), np.asarray(y).view(np.uint8))
    dx = grouped_dgrad(dys, ws, out_dtype=out_dtype)
    assert_correctly_rounded(dx, np.concatenate([d @ w for d, w in zip(f(dys), f(ws))]), out_dtype)
    dw = grouped_wgrad(xs, dys, out_dtype=out_dtype)
    assert_correctly_rounded(dw, np.stack([d.T @ x for d, x in zip(f(dys), f(xs))]), out_dtype)


def test_reference_writes_into_out():
    X, W, DY = make_fp8([3, 0, 18], 32, 16, seed=4)
    out = np.zeros((21, 16), ml_dtypes.bfloat16)
    assert grouped_fprop(X, W, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint16),
                                  np.asarray(grouped_fprop(X, W)).view(np.uint16))
    out16 = np.zeros((21, 16), np.uint16)  # a bf16 carrier, tagged by out_dtype
    grouped_fprop(X, W, out=out16)
    np.testing.assert_array_equal(out16, out.view(np.uint16))


# ---------------------------------------------------------------------------------------------
# Planning: pure functions of sizes and pointers.

def test_pointer_alignment():
    assert gg.pointer_alignment(0) == 256
    assert gg.pointer_alignment(0x7F0000001000) == 256
    assert gg.pointer_alignment(0x7F0000001010) == 16
    assert gg.pointer_alignment(0x7F0000001002) == 2
    assert gg.pointer_alignment(0x7F0000001001) == 1
    assert gg.pointer_alignment(0x40, cap=32) == 32


def test_pointer_alignments_apply_the_scalar_rule_to_every_pointer():
    """The vectorized form (what plan_arrays and the alignment check use) is
    :func:`pointer_alignment` per pointer, a null pointer included."""
    ptrs = [0, 0x7F0000001000, 0x7F0000001010, 0x7F0000001002, 0x7F0000001001, 0x40]
    for cap in (256, 32):
        assert gg.pointer_alignments(ptrs, cap=cap).tolist() == \
            [gg.pointer_alignment(p, cap=cap) for p in ptrs]


def _fake_problem_fprop(m_splits, k, n, base_x=0x10000, base_w=0x900000):
    left, right, off = [], [], 0
    for i, m in enumerate(m_splits):
        left.append(gg.Block(base_x + off * k, m, k, k, "float8_e4m3fn"))
        right.append(gg.Block(base_w + i * n * k, n, k, k, "float8_e4m3fn"))
        off += m
    scales_x = tuple(0x5000 + 4 * i for i in range(len(m_splits)))
    scales_w = tuple(0x6000 + 4 * i for i in range(len(m_splits)))
    return gg.Problem("fprop", True, tuple(left), False, tuple(right), True, (k,) * len(m_splits),
                      scales_x, scales_w, None, None, True, False, "bfloat16", (True, 0, "cupy"))


def test_plan_fprop_fp8_is_tn_with_offsets_leading_dims_and_empty_experts_skipped():
    m_splits, k, n = [5, 0, 19, 3], 64, 32
    problem = _fake_problem_fprop(m_splits, k, n)
    out_base = 0x200000
    out, row = [], 0
    for m in m_splits:
        out.append(gg.Block(out_base + row * n * 2, m, n, n, "bfloat16"))
        row += m
    plan = gg.plan_problem(problem, out)
    assert plan.skipped == (1,) and plan.zero == ()
    assert [c.expert for c in plan.calls] == [0, 2, 3]
    assert plan.config.transa == E.CUBLAS_OP_T and plan.config.transb == E.CUBLAS_OP_N
    assert plan.config.scaled and plan.config.fast_accum
    rows_before = {0: 0, 2: 5, 3: 24}
    for c in plan.calls:
        m = m_splits[c.expert]
        assert (c.m, c.n, c.k) == (n, m, k)  # cuBLAS sizes: D is n x m col-major
        assert c.a_layout == (E.CUDA_R_8F_E4M3, k, n, k)  # W_i (n, k) row-major, OP_T
        assert c.b_layout == (E.CUDA_R_8F_E4M3, k, m, k)  # x_i (m, k) row-major, OP_N
        assert c.d_layout == (E.CUDA_R_16BF, n, m, n)
        assert c.a_ptr == 0x900000 + c.expert * n * k
        assert c.b_ptr == 0x10000 + rows_before[c.expert] * k
        assert c.d_ptr == out_base + rows_before[c.expert] * n * 2
        assert c.a_scale_ptr == 0x6000 + 4 * c.expert and c.b_scale_ptr == 0x5000 + 4 * c.expert
        assert c.alignments == tuple(gg.pointer_alignment(p) for p in
                                     (c.a_ptr, c.b_ptr, c.d_ptr, c.d_ptr))
        assert c.beta == 0.0
    # expert 3 starts at row 24: x at +24*64 bytes (256-aligned), y at +24*32*2 (256-aligned)
    assert plan.calls[1].alignments == (256, gg.pointer_alignment(0x10000 + 5 * 64), 64, 64)


def test_plans_from_real_operands_for_every_pass():
    m_splits, k, n = [5, 0, 19], 48, 32
    X, W, DY = make_fp8(m_splits, k, n, seed=1)
    base = lambda a: np.asarray(a).ctypes.data  # noqa: E731
    # dgrad: A = W_iᵀ (k, n) from the transposed copy with ld = n_pad (= n with align=1), OP_T
    p = gg.check_dgrad(DY, W)
    out = np.empty((24, k), ml_dtypes.bfloat16)
    _, blocks = gg.outputs(p, out, np)
    plan = gg.plan_problem(p, blocks)
    c = plan.calls[1]
    assert (c.m, c.n, c.k) == (k, 19, n)
    assert c.a_layout == (E.CUDA_R_8F_E4M3, n, k, n) and c.a_ptr == base(W.data_t) + 2 * k * n  # expert 2 (1 is skipped)
    assert c.b_layout == (E.CUDA_R_8F_E5M2, n, 19, n) and c.b_ptr == base(DY.data) + 5 * n
    assert c.d_layout == (E.CUDA_R_16BF, k, 19, k) and c.d_ptr == out.ctypes.data + 5 * k * 2
    assert (c.transa, c.transb) == (E.CUBLAS_OP_T, E.CUBLAS_OP_N)
    # wgrad: reduction over m_pad, A = x_iᵀ (k, m_pad) OP_T, B = dy_iᵀ (n, m_pad) OP_N, D (E, n, k)
    p = gg.check_wgrad(X, DY)
    _, blocks = gg.outputs(p, None, np)
    plan = gg.plan_problem(p, blocks)
    assert plan.zero == (1,) and plan.skipped == (1,)
    c = plan.calls[1]
    assert (c.m, c.n, c.k) == (k, n, 32)  # m_pad of 19 is 32
    assert c.a_layout == (E.CUDA_R_8F_E4M3, 32, k, 32)
    assert c.a_ptr == base(X.data_t) + k * 16  # expert 0's block is k x 16
    assert c.b_layout == (E.CUDA_R_8F_E5M2, 32, n, 32) and c.b_ptr == base(DY.data_t) + n * 16
    assert c.d_layout == (E.CUDA_R_32F, k, n, k)
    # accumulating: nothing zeroed, beta = 1
    p = gg.check_wgrad(X, DY, accumulate=True)
    _, blocks = gg.outputs(p, np.zeros((3, n, k), np.float32), np)
    plan = gg.plan_problem(p, blocks)
    assert plan.zero == () and all(c.beta == 1.0 for c in plan.calls)


def test_vectorized_plan_equals_the_per_expert_mapping():
    """The launch's vectorized plan (plan_arrays) makes exactly the calls plan_expert describes,
    for every pass, FP8 and plain, with empty experts and accumulation."""
    m_splits, k, n = [5, 0, 19, 1, 0, 33], 48, 32
    X, W, DY = make_fp8(m_splits, k, n, seed=4)
    rng = np.random.default_rng(0)
    xs = [rand(rng, (m, k)).astype(ml_dtypes.bfloat16) for m in m_splits]
    ws = [rand(rng, (n, k)).astype(ml_dtypes.bfloat16) for _ in m_splits]
    dys = [rand(rng, (m, n)).astype(ml_dtypes.bfloat16) for m in m_splits]
    bias = np.zeros((6, n), ml_dtypes.bfloat16)
    for p in (gg.check_fprop(X, W, bias), gg.check_dgrad(DY, W), gg.check_wgrad(X, DY),
              gg.check_wgrad(X, DY, accumulate=True), gg.check_fprop(xs, ws, out_dtype="float32"),
              gg.check_dgrad(dys, ws), gg.check_wgrad(xs, dys)):
        out = np.zeros((6, n, k), np.float32) if p.accumulate else None
        _, blocks = gg.outputs(p, out, np)
        want, zero, skipped = [], [], []
        for i, (left, right, o, r) in enumerate(zip(p.left, p.right, blocks, p.reduction)):
            if o.rows == 0 or o.cols == 0 or r == 0:
                skipped.append(i)
                if r == 0 and o.rows * o.cols and not p.accumulate:
                    zero.append(i)
                continue
            want.append(gg.plan_expert(
                i, left, p.left_t, right, p.right_t, o, r, beta=1.0 if p.accumulate else 0.0,
                a_scale_ptr=p.right_scale[i] if p.right_scale is not None else 0,
                b_scale_ptr=p.left_scale[i] if p.left_scale is not None else 0,
                bias_ptr=p.bias[i] if p.bias is not None else 0))
        plan = gg.plan_problem(p, blocks)
        assert plan.calls == tuple(want), p.pass_name
        assert (plan.zero, plan.skipped) == (tuple(zero), tuple(skipped))
        vp = gg.plan_arrays(p, blocks)
        assert [tuple(r) for r in vp.keys[:, 12:16].tolist()] == [c.alignments for c in want]


def test_plan_keys_end_with_the_bias_pointers_alignment():
    """A call's shape signature selects its cached algorithm, which the heuristic chose with the
    bias pointer set: its last entry is the bias pointer's own alignment (0 without a bias), not
    that of another pointer (here the scales are 4-byte aligned, the bias rows 32 or more)."""
    m_splits, k, n = [16, 0, 32, 16], 32, 48
    X, W, _ = make_fp8(m_splits, k, n, seed=5)
    bias = np.zeros((4, n), ml_dtypes.bfloat16)          # rows 96 bytes apart
    for b in (bias, None):
        p = gg.check_fprop(X, W, b)
        _, blocks = gg.outputs(p, None, np)
        vp = gg.plan_arrays(p, blocks)
        want = [gg.pointer_alignment(bias[e].ctypes.data) if b is not None else 0
                for e in (0, 2, 3)]
        assert vp.experts.tolist() == [0, 2, 3]
        assert vp.keys[:, 16].tolist() == want


def test_plan_names_the_expert_with_a_wrong_shape():
    p = _fake_problem_fprop([4, 7], 32, 16)
    bad = (p.left[0], gg.Block(p.left[1].ptr, 7, 48, 48, "float8_e4m3fn"))
    p = dataclasses.replace(p, left=bad)
    out = [gg.Block(0x100000, 4, 16, 16, "bfloat16"), gg.Block(0x100100, 7, 16, 16, "bfloat16")]
    with pytest.raises(ValueError, match="expert 1: left operand is 7x48, expected 7x32"):
        gg.plan_problem(p, out)


def test_host_loop_runs_on_the_cpu_with_real_descriptors():
    """The launch loop itself (templates, per-expert descriptors, pointer updates) with only the
    device calls faked, as the host benchmark runs it; pointers that move are re-set."""
    from cugrouped.bench.gemm import host_loop_state
    from cugrouped.cublaslt import descriptors as D

    st = host_loop_state()
    seen = []
    st.matmul = lambda *args: seen.append(args) or 0
    X, W, _ = make_fp8([5, 0, 19, 3], 32, 16, seed=1)
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    vp = gg.plan_arrays(p, blocks)
    with cugrouped.record_launches() as log:
        gg._launch_plan(vp, p, blocks, st)
    # experts 0, 2, 3 read scale_inv[0], [2], [3] of each (4,) array: not all 16-byte aligned,
    # so each operand's span is copied once (one strided copy) into the fake scratch first
    copies, rows = vp.realigned(st.scale_scratch(vp.scale_scratch_bytes))
    assert vp.misaligned_scales and [(c.spitch, c.height) for c in copies] == [(4, 4), (4, 4)]
    assert [e.kernel for e in log] == ["cudaMemcpy2DAsync[scales]"] * 2 + ["cublasLtMatmul"] * 3
    assert len(seen) == 3
    calls = vp.calls()
    for args, c, row in zip(seen, calls, rows):
        assert (args[3], args[5], args[8], args[10]) == (c.a_ptr, c.b_ptr, c.d_ptr, c.d_ptr)
        desc = D.expert_desc(vp.config, c.expert)
        assert desc.handle.value == args[1].value
        assert (desc.get("A_SCALE_POINTER"), desc.get("B_SCALE_POINTER")) == tuple(row[4:6])
        assert row[4] % 16 == row[5] % 16 == 0
    assert len(st.templates[vp.config]) == 3  # three distinct token counts, three templates
    # the scales move: the copies read them from their new place, into the same slots
    X2 = dataclasses.replace(X, scale_inv=np.asarray(X.scale_inv).copy())
    p2 = gg.check_fprop(X2, W)
    vp2 = gg.plan_arrays(p2, blocks)
    gg._launch_plan(vp2, p2, blocks, st)
    copies2, rows2 = vp2.realigned(st.scale_scratch(vp2.scale_scratch_bytes))
    assert copies2[1].src == X2.scale_inv.ctypes.data and rows2 == rows
    for c, row in zip(vp2.calls(), rows2):
        assert D.expert_desc(vp2.config, c.expert).get("B_SCALE_POINTER") == row[5]
    # scales already in 16-byte slots: no copy, the descriptors take the pointers as they are
    ptrs = vp.ptrs.copy()
    ptrs[:, 4:6] = 0x7C0000000000 + 16 * np.arange(6).reshape(3, 2)
    vp3 = dataclasses.replace(vp, ptrs=ptrs)
    with cugrouped.record_launches() as log:
        gg._launch_plan(vp3, p, blocks, st)
    assert not vp3.misaligned_scales and [e.kernel for e in log] == ["cublasLtMatmul"] * 3
    for c in vp3.calls():
        assert D.expert_desc(vp3.config, c.expert).get("B_SCALE_POINTER") == c.b_scale_ptr
    D.clear_caches()


@pytest.mark.parametrize("case", ["array", "skipped", "same", "scattered", "sparse", "one",
                                  "far"])
def test_scale_copies_put_each_callers_float_in_a_16_byte_slot(case):
    """The plan of the scale copies, on host memory: each call's new pointer is 16-byte aligned
    and holds the float its old pointer held; an (E,) array (empty experts skipped or not) is
    one strided copy, one float shared by every call one copy, scattered floats one copy each."""
    import ctypes

    rng = np.random.default_rng(len(case))
    pool = rng.standard_normal(64).astype(np.float32)
    base = pool.ctypes.data
    idx = {"array": [0, 1, 2, 3, 4], "skipped": [0, 2, 3, 7], "same": [5, 5, 5],
           "scattered": [9, 2, 40, 41], "sparse": [0, 1, 63], "one": [6], "far": [3, 5]}[case]
    src = base + 4 * np.asarray(idx, np.int64)
    if case == "far":                     # two allocations far apart: no strided read between
        # (the middle of a 1 MiB array: anything outside it, the pool too, is 512 KiB away)
        far = rng.standard_normal(1 << 18).astype(np.float32)
        src = np.asarray([base + 12, far.ctypes.data + (1 << 19)], np.int64)
        assert abs(int(src[1] - src[0])) > gg.SCALE_SPAN_MAX
    if case == "scattered":
        src[1] += 1                       # an odd byte offset: no common step of 4 or more
        pool.view(np.uint8)[9:13] = pool.view(np.uint8)[8:12].copy()
    scratch = np.full(16 * 80 + 16, 0xFF, np.uint8)
    dst = scratch.ctypes.data + (-scratch.ctypes.data % 16)
    copies, new = gg.scale_copies(src, dst)
    for c in copies:
        for i in range(c.height):
            ctypes.memmove(c.dst + 16 * i, c.src + c.spitch * i, 4)
    want_copies = {"array": 1, "skipped": 1, "same": 1, "scattered": 4, "sparse": 3, "one": 1,
                   "far": 2}
    assert len(copies) == want_copies[case]
    assert sum(c.height for c in copies) <= 80
    assert (new % 16 == 0).all()
    got = [ctypes.c_float.from_address(int(p)).value for p in new]
    want = [ctypes.c_float.from_address(int(p)).value for p in src]
    assert np.array_equal(np.float32(got), np.float32(want))


def test_plain_layouts_are_natural():
    """Without FP8 no TN rule: dgrad is NN on W (n, k), wgrad NT on x, dy (m, ·); no padding."""
    rng = np.random.default_rng(0)
    ms, k, n = [3, 7], 24, 40
    xs = [rand(rng, (m, k)).astype(ml_dtypes.bfloat16) for m in ms]
    ws = [rand(rng, (n, k)).astype(ml_dtypes.bfloat16) for _ in ms]
    dys = [rand(rng, (m, n)).astype(ml_dtypes.bfloat16) for m in ms]
    p = gg.check_dgrad(dys, ws)
    plan = gg.plan_problem(p, gg.outputs(p, None, np)[1])
    assert (plan.config.transa, plan.config.transb) == (E.CUBLAS_OP_N, E.CUBLAS_OP_N)
    assert plan.calls[1].a_layout == (E.CUDA_R_16BF, k, n, k)
    p = gg.check_wgrad(xs, dys)
    plan = gg.plan_problem(p, gg.outputs(p, None, np)[1])
    assert (plan.config.transa, plan.config.transb) == (E.CUBLAS_OP_N, E.CUBLAS_OP_T)
    c = plan.calls[1]
    assert (c.m, c.n, c.k) == (k, n, 7)
    assert c.a_layout == (E.CUDA_R_16BF, k, 7, k) and c.b_layout == (E.CUDA_R_16BF, n, 7, n)
    assert not plan.config.scaled


def test_alignment_check_names_the_misaligned_operand():
    X, W, _ = make_fp8([4, 4], 32, 16, seed=0)
    p = gg.check_fprop(X, W)
    buf = np.zeros(8 * 16 + 1, np.uint16)
    out = buf[1:].reshape(8, 16)  # 2-byte aligned: fine for bf16 elements, not for FP8 GEMMs
    _, blocks = gg.outputs(p, out.view(ml_dtypes.bfloat16), np)
    with pytest.raises(ValueError, match=r"out of expert 0: address .* is not 16-byte aligned"):
        gg.check_alignment(p, blocks)


def test_workspace_per_stream():
    assert gg.workspace_bytes_for(90) == 32 << 20 and gg.workspace_bytes_for(100) == 32 << 20
    assert gg.workspace_bytes_for(89) == 4 << 20


# ---------------------------------------------------------------------------------------------
# Descriptors for every pass and dtype combination, against the real library (no GPU needed).

def _combos():
    for pass_name in ("fprop", "dgrad", "wgrad"):
        for pair in PAIRS:
            for out_dtype in OUT_DTYPES:
                for extra in ((False, True) if pass_name == "fprop" else (False,)):
                    yield pass_name, "x".join(pair), out_dtype, extra
        for dtype, outs in (("bfloat16", ("bfloat16", "float32")), ("float16", ("float16", "float32")),
                            ("float32", ("float32",))):
            for out_dtype in outs:
                yield pass_name, dtype, out_dtype, pass_name == "fprop"


@pytest.mark.parametrize("pass_name,operands,out_dtype,bias", list(_combos()))
def test_descriptors_accept_every_attribute_the_op_sets(pass_name, operands, out_dtype, bias):
    from cugrouped import cublaslt
    from cugrouped.cublaslt import descriptors as D

    try:
        cublaslt.lib()
    except OSError as exc:  # pragma: no cover - the test environment installs nvidia-cublas
        pytest.skip(f"libcublasLt not installed: {exc}")

    m_splits, k, n = [5, 0, 19], 32, 48
    if "x" in operands:  # FP8: the pair is (A, B) of the cuBLAS call
        a_fmt, b_fmt = operands.split("x")
        fmts = {"fprop": dict(w_fmt=a_fmt, x_fmt=b_fmt, g_fmt="e4m3"),
                "dgrad": dict(w_fmt=a_fmt, g_fmt=b_fmt, x_fmt="e4m3"),
                "wgrad": dict(x_fmt=a_fmt, g_fmt=b_fmt, w_fmt="e4m3")}[pass_name]
        X, W, DY = make_fp8(m_splits, k, n, seed=2, **fmts)
    else:
        rng = np.random.default_rng(0)
        dt = NP_DTYPE[operands]
        X = [rand(rng, (m, k)).astype(dt) for m in m_splits]
        W = [rand(rng, (n, k)).astype(dt) for _ in m_splits]
        DY = [rand(rng, (m, n)).astype(dt) for m in m_splits]
    bias_arr = None
    if bias:
        bias_arr = np.zeros((3, n), NP_DTYPE[gg.bias_dtype_for(out_dtype, "x" in operands)])
    problem = {"fprop": lambda: gg.check_fprop(X, W, bias_arr, out_dtype=out_dtype),
               "dgrad": lambda: gg.check_dgrad(DY, W, out_dtype=out_dtype),
               "wgrad": lambda: gg.check_wgrad(X, DY, out_dtype=out_dtype)}[pass_name]()
    _, blocks = gg.outputs(problem, None, np)
    plan = gg.plan_problem(problem, blocks)
    assert plan.calls
    ws = gg.workspace_bytes_for(90)
    for call in plan.calls:
        desc, la, lb, ld, pref = gg.build_descriptors(plan.config, call, ws)
        for name, value in plan.config.attributes().items():
            assert desc.get(name) == value, name
        assert desc.get("COMPUTE_TYPE") == E.CUBLAS_COMPUTE_32F
        assert desc.get("SCALE_TYPE") == E.CUDA_R_32F
        if plan.config.scaled:
            assert desc.get("A_SCALE_POINTER") == call.a_scale_ptr != 0
            assert desc.get("B_SCALE_POINTER") == call.b_scale_ptr != 0
        if bias:
            assert desc.get("BIAS_POINTER") == call.bias_ptr != 0
            assert desc.get("EPILOGUE") == E.CUBLASLT_EPILOGUE_BIAS
        for lay, want in ((la, call.a_layout), (lb, call.b_layout), (ld, call.d_layout)):
            assert tuple(lay.get(a) for a in ("TYPE", "ROWS", "COLS", "LD")) == want
            assert lay.get("ORDER") == E.CUBLASLT_ORDER_COL
        assert pref.get("MAX_WORKSPACE_BYTES") == ws
        assert tuple(pref.get(f"MIN_ALIGNMENT_{x}_BYTES") for x in "ABCD") == call.alignments
    D.clear_caches()


# ---------------------------------------------------------------------------------------------
# Grouped GEMM (cuBLASLt 13.x): the decision and the descriptors, on the CPU.

def test_grouped_gemm_capability_rules():
    f = gg.grouped_gemm_unsupported
    assert f(131000, 90, fp8=True, in_dtype="float8_e4m3fn") is None
    assert f(130500, 90, fp8=True, in_dtype="float8_e4m3fn") is None
    assert "needs cuBLAS 13.5+" in f(130400, 90, fp8=True, in_dtype="float8_e4m3fn")
    assert f(130400, 90, fp8=False, in_dtype="bfloat16") is None
    assert "needs cuBLAS 13.4+" in f(130300, 90, fp8=False, in_dtype="bfloat16")
    assert f(130300, 100, fp8=True, in_dtype="float8_e5m2") is None
    assert "needs cuBLAS 13.3+" in f(130200, 100, fp8=False, in_dtype="float16")
    assert "not sm_89" in f(131000, 89, fp8=True, in_dtype="float8_e4m3fn")
    assert "not sm_120" in f(131000, 120, fp8=False, in_dtype="bfloat16")
    assert "float32" in f(131000, 90, fp8=False, in_dtype="float32")
    assert "no cublasLtGroupedMatrixLayoutCreate" in f(120900, 90, fp8=False, in_dtype="bfloat16",
                                                       has_symbol=False)


def _planned(m_splits, k=32, n=48, bias=False):
    X, W, DY = make_fp8(m_splits, k, n, seed=3)
    b = np.zeros((len(m_splits), n), ml_dtypes.bfloat16) if bias else None
    p = gg.check_fprop(X, W, b)
    _, blocks = gg.outputs(p, None, np)
    return p, gg.plan_arrays(p, blocks)


def test_choose_path():
    kw = dict(version=131000, compute_capability=90, has_symbol=True, discrete_out=False)
    p, vp = _planned([16, 0, 48, 32])
    assert gg.choose_path(p, vp, **kw) == ("grouped", "supported")
    assert gg.choose_path(p, vp, **kw, requested="loop") == ("loop", "requested")
    assert gg.choose_path(p, vp, **{**kw, "compute_capability": 89})[0] == "loop"
    p2, vp2 = _planned([16, 5, 32])  # 5 tokens: not 16 bytes of FP8
    path, why = gg.choose_path(p2, vp2, **kw)
    assert path == "loop" and "multiple of 16" in why
    with pytest.raises(RuntimeError, match="path='grouped' cannot run: .*multiple of 16"):
        gg.choose_path(p2, vp2, **kw, requested="grouped")
    p3, vp3 = _planned([16, 32], bias=True)
    assert "bias" in gg.choose_path(p3, vp3, **kw)[1]
    assert "corrupts" in gg.choose_path(p, vp, **{**kw, "version": 130800, "discrete_out": True})[1]
    assert gg.choose_path(p, vp, **{**kw, "version": 130800})[0] == "grouped"
    # CUDA 13.4 U1's known issue: wrong results on Blackwell from 13.7.0, every grouped call
    bw = gg.choose_path(p, vp, **{**kw, "version": 130800, "compute_capability": 100})
    assert bw[0] == "loop" and "Blackwell" in bw[1]
    assert gg.choose_path(p, vp, **{**kw, "version": 130801, "compute_capability": 100})[0] == \
        "grouped"
    p4, vp4 = _planned([0, 16, 0])
    assert "fewer than two" in gg.choose_path(p4, vp4, **kw)[1]
    with pytest.raises(ValueError, match="path: got 'fast'"):
        gg.choose_path(p, vp, **kw, requested="fast")


def _fake_plan(m_splits, k=32, n=48):
    p = _fake_problem_fprop(m_splits, k, n)
    out, row = [], 0
    for m in m_splits:
        out.append(gg.Block(0x200000 + row * n * 2, m, n, n, "bfloat16"))
        row += m
    return p, gg.plan_arrays(p, out)


def test_choose_path_at_the_edges_of_each_rule():
    """Each documented limit on both sides: sm_90 and sm_100..sm_110, the per-group-output
    corruption of cuBLAS [13.7.0, 13.8.1), at most 256 groups, and m, n, k in multiples of 16
    bytes (8 elements of bfloat16, 16 of FP8)."""
    f = gg.grouped_gemm_unsupported
    for cc in (90, 100, 110):
        assert f(131000, cc, fp8=True, in_dtype="float8_e4m3fn") is None, cc
    for cc in (89, 111):
        assert f"not sm_{cc}" in f(131000, cc, fp8=True, in_dtype="float8_e4m3fn")
    kw = dict(compute_capability=90, has_symbol=True)
    p, vp = _fake_plan([16, 0, 48, 32])
    for version, path in ((130699, "grouped"), (130700, "loop"), (130800, "loop"),
                          (130801, "grouped")):
        got, why = gg.choose_path(p, vp, version=version, discrete_out=True, **kw)
        assert got == path and (path == "grouped" or "corrupts" in why), version
    kw.update(version=131000, discrete_out=False)
    assert gg.choose_path(*_fake_plan([16] * 256), **kw) == ("grouped", "supported")
    assert gg.choose_path(*_fake_plan([16] * 257), **kw) == ("loop", "more than 256 experts")
    rng = np.random.default_rng(7)
    ws = [rand(rng, (48, 32)).astype(ml_dtypes.bfloat16) for _ in range(3)]
    for m_splits, path in (([8, 24, 16], "grouped"), ([8, 4, 16], "loop")):
        xs = [rand(rng, (m, 32)).astype(ml_dtypes.bfloat16) for m in m_splits]
        p = gg.check_fprop(xs, ws)
        _, blocks = gg.outputs(p, None, np)
        got, why = gg.choose_path(p, gg.plan_arrays(p, blocks), **kw)
        assert got == path and (path == "grouped" or "multiple of 8 elements" in why), m_splits


def test_grouped_workspace_layout():
    off, total = gg.grouped_workspace_layout(5)
    ptrs = [off[n] for n in gg.GROUPED_PTR_ARRAYS]
    assert all(o % 16 == 0 for o in ptrs) and ptrs == sorted(ptrs)
    assert all(b - a >= 40 for a, b in zip(ptrs, ptrs[1:]))
    ints = [off[n] for n in gg.GROUPED_INT_ARRAYS]
    assert ints[0] >= ptrs[-1] + 40 and all(b - a == 20 for a, b in zip(ints, ints[1:]))
    assert off["alpha"] % 16 == 0 and off["alpha"] >= ints[-1] + 20
    assert off["beta"] == off["alpha"] + 4 and total >= off["beta"] + 4


def test_grouped_descriptors_on_the_real_library():
    from cugrouped import cublaslt

    if not cublaslt.has_grouped_gemm():
        pytest.skip(NO_GROUPED_LIB)
    p, vp = _planned([16, 0, 48, 32])
    cfg = dataclasses.replace(vp.config, grouped=True)
    base = 0x7F1234560000
    desc, la, lb, lc, ld, pref = gg.grouped_descriptors(cfg, 4, base, vp, 32 << 20)
    off, _ = gg.grouped_workspace_layout(4)
    for name, value in cfg.attributes().items():
        assert desc.get(name) == value, name
    assert desc.get("A_SCALE_POINTER") == base + off["a_scale"]
    assert desc.get("B_SCALE_POINTER") == base + off["b_scale"]
    for lay, x, t in ((la, "a", E.CUDA_R_8F_E4M3), (lb, "b", E.CUDA_R_8F_E4M3),
                      (lc, "d", E.CUDA_R_16BF), (ld, "d", E.CUDA_R_16BF)):
        assert lay.get("TYPE") == t and lay.get("BATCH_COUNT") == 4
        assert (lay.get("ROWS_ARRAY"), lay.get("COLS_ARRAY"), lay.get("LD_ARRAY")) == \
            (base + off[f"{x}_rows"], base + off[f"{x}_cols"], base + off[f"{x}_ld"])
    assert pref.get("MAX_WORKSPACE_BYTES") == 32 << 20
    # sums over the computed calls divided by the 4 groups (the empty expert adds 0): 144, 96, 96
    assert (pref.get("GROUPED_DESC_D_AVERAGE_ROWS"), pref.get("GROUPED_DESC_D_AVERAGE_COLS"),
            pref.get("GROUPED_AVERAGE_REDUCTION_DIM")) == (36, 24, 24)


def test_grouped_descriptors_average_over_the_groups_written():
    """The launch passes the groups the setup kernel writes, the computed experts: the
    heuristic's average D rows, D columns and reduction are then the means of those calls."""
    from cugrouped import cublaslt

    if not cublaslt.has_grouped_gemm():
        pytest.skip(NO_GROUPED_LIB)
    p, vp = _planned([16, 0, 48, 32])
    groups = vp.mnk.shape[0]
    cfg = dataclasses.replace(vp.config, grouped=True)
    *_, pref = gg.grouped_descriptors(cfg, groups, 0x7F1234560000, vp, 32 << 20)
    sums = [sum(c) for c in zip(*vp.mnk.tolist())]        # 3 calls: (144, 96, 96)
    assert (pref.get("GROUPED_DESC_D_AVERAGE_ROWS"), pref.get("GROUPED_DESC_D_AVERAGE_COLS"),
            pref.get("GROUPED_AVERAGE_REDUCTION_DIM")) == tuple(v // groups for v in sums) \
        == (48, 32, 32)


# ---------------------------------------------------------------------------------------------
# Argument checks: clear errors before anything runs.

@pytest.fixture(scope="module")
def ops():
    return make_fp8([5, 0, 19], 32, 48, seed=0)


def test_e5m2_pair_refused(ops):
    X, W, DY = ops
    W5 = make_fp8([5, 0, 19], 32, 48, seed=0, w_fmt="e5m2")[1]
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        grouped_dgrad(DY, W5)  # dy is e5m2
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        grouped_wgrad(make_fp8([5, 0, 19], 32, 48, 0, x_fmt="e5m2")[0], DY)


def test_fp8_dims_must_be_multiples_of_16():
    X, W, DY = make_fp8([5, 3], 40, 48, seed=0)
    with pytest.raises(ValueError, match=r"^k \(x.k, w.k\): FP8 GEMMs need a multiple of 16, got 40"):
        grouped_fprop(X, W)
    X, W, DY = make_fp8([5, 3], 32, 40, seed=0)
    with pytest.raises(ValueError, match=r"^n \(w's rows per expert\): .* got 40"):
        grouped_fprop(X, W)
    with pytest.raises(ValueError, match=r"^n \(dy.k"):
        grouped_dgrad(DY, W)


def test_wgrad_needs_padding_to_16():
    rng = np.random.default_rng(0)
    xs = [rand(rng, (m, 32)) for m in (5, 3)]
    X1 = cugrouped.multi_pad_cast_transpose(xs, align=1)
    D1 = cugrouped.multi_pad_cast_transpose([rand(rng, (m, 16)) for m in (5, 3)], fp8_format="e5m2",
                                            align=1)
    with pytest.raises(ValueError, match="expert 0 has m_pad=5 .*align=16"):
        grouped_wgrad(X1, D1)
    D16 = cugrouped.multi_pad_cast_transpose([rand(rng, (m, 16)) for m in (5, 3)], fp8_format="e5m2")
    with pytest.raises(ValueError, match="padded token counts differ"):
        grouped_wgrad(X1, D16)


def test_mismatched_experts_and_shapes(ops):
    X, W, DY = ops
    W2 = make_fp8([1, 1], 32, 48, seed=0)[1]
    with pytest.raises(ValueError, match="w has 2 experts but x has 3"):
        grouped_fprop(X, W2)
    Xk = make_fp8([5, 0, 19], 64, 48, seed=0)[0]
    with pytest.raises(ValueError, match="w: has k=32 columns but x has k=64"):
        grouped_fprop(Xk, W)
    X2 = make_fp8([5, 1, 19], 32, 48, seed=0)[0]
    with pytest.raises(ValueError, match="token counts per expert differ"):
        grouped_wgrad(X2, DY)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"w: every expert must have the same n"):
        grouped_fprop([rand(rng, (3, 8))] * 2, [rand(rng, (4, 8)), rand(rng, (5, 8))],
                      out_dtype="float32")


def test_swapped_operands_get_a_hint_only_when_the_shapes_say_so(ops):
    X, W, DY = ops                    # tokens per expert (5, 0, 19); W: 48 rows per expert
    hint = r" \({0} has the same rows in every expert, as weights do: did you pass {0} and w in " \
        r"the wrong order\?\)$"
    with pytest.raises(ValueError, match=r"^w: every expert must have the same n \(rows\), got "
                       r"\[0, 5, 19\]" + hint.format("x")):
        grouped_fprop(W, X)
    with pytest.raises(ValueError, match=r"^w: every expert must have the same n \(rows\), got "
                       r"\[0, 5, 19\]" + hint.format("dy")):
        grouped_dgrad(W, DY)
    rng = np.random.default_rng(0)
    ws = [rand(rng, (16, 8)) for _ in range(3)]
    xs = [rand(rng, (m, 8)) for m in (5, 0, 19)]
    with pytest.raises(ValueError, match=r"got \[0, 5, 19\]" + hint.format("x")):
        grouped_fprop(ws, xs)                                       # plain operands too
    with pytest.raises(ValueError, match=r"^w: every expert must have the same n \(rows\), got "
                       r"\[4, 5\]$"):    # x's rows differ too: no reason to suspect the order
        grouped_fprop([rand(rng, (3, 8)), rand(rng, (2, 8))], [rand(rng, (4, 8)),
                                                               rand(rng, (5, 8))])


def test_wrong_out(ops):
    X, W, DY = ops
    with pytest.raises(ValueError, match=r"out: expected shape \(24, 48\), got \(24, 47\)"):
        grouped_fprop(X, W, out=np.zeros((24, 47), ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="out: dtype float32 differs from out_dtype='bfloat16'"):
        grouped_fprop(X, W, out=np.zeros((24, 48), np.float32))
    with pytest.raises(ValueError, match="unit column stride"):
        grouped_fprop(X, W, out=np.zeros((48, 24), ml_dtypes.bfloat16).T)
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 48, 32\)"):
        grouped_wgrad(X, DY, out=np.zeros((3, 32, 48), np.float32))
    with pytest.raises(ValueError, match="out: expected 3 per-expert arrays, got 2"):
        grouped_wgrad(X, DY, out=[np.zeros((48, 32), np.float32)] * 2)
    with pytest.raises(ValueError, match="accumulate=True adds into existing gradients"):
        grouped_wgrad(X, DY, accumulate=True)
    with pytest.raises(ValueError, match="out_dtype: got 'float64'"):
        grouped_fprop(X, W, out_dtype="float64")


def test_out_dtype_takes_dtype_objects_as_their_names(ops):
    """NumPy dtypes and scalar types, ml_dtypes.bfloat16 and torch dtypes name the same output
    dtypes as the strings: the same result bits; anything else lists the accepted names."""
    X, W, DY = ops
    torch = pytest.importorskip("torch")
    spellings = {"bfloat16": (ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16), torch.bfloat16),
                 "float16": (np.float16, np.dtype("float16"), torch.float16),
                 "float32": (np.float32, np.dtype(np.float32), torch.float32)}
    for name, objs in spellings.items():
        want = grouped_fprop(X, W, out_dtype=name)
        wg = grouped_wgrad(X, DY, out_dtype=name)
        for obj in objs:
            got = grouped_fprop(X, W, out_dtype=obj)
            assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8),
                                                              want.view(np.uint8)), obj
            assert np.array_equal(grouped_wgrad(X, DY, out_dtype=obj).view(np.uint8),
                                  wg.view(np.uint8)), obj
    assert grouped_dgrad(DY, W, out_dtype=torch.float16).dtype == np.float16
    for bad in (np.float64, torch.float64, torch.int8, "fp16", 3):
        with pytest.raises(ValueError, match=r"^out_dtype: got .*, expected one of \('bfloat16', "
                           r"'float16', 'float32'\) \(a name, or its NumPy, ml_dtypes or torch "
                           r"dtype\)$"):
            grouped_fprop(X, W, out_dtype=bad)


def test_operand_kinds_and_dtypes(ops):
    X, W, DY = ops
    rng = np.random.default_rng(0)
    plain = [rand(rng, (m, 32)) for m in (5, 0, 19)]
    with pytest.raises(ValueError, match="must be arrays of the same kind on the same device, got "
                                         "torch on the host and numpy on the host"):
        grouped_fprop(plain, [pytest.importorskip("torch").from_numpy(rand(rng, (48, 32)))] * 3)
    with pytest.raises(TypeError, match="w is a GroupedFP8 but x is not"):
        grouped_fprop(plain, W)
    with pytest.raises(TypeError, match=r"x: dtype float32 differs from w's float16"):
        grouped_fprop(plain, [rand(rng, (48, 32)).astype(np.float16)] * 3, out_dtype="float32")
    with pytest.raises(ValueError, match=r"out_dtype: float32 operands give \('float32',\) "
                       r"outputs in cuBLASLt, got 'bfloat16' \(pass out_dtype='float32', or None\)"):
        grouped_fprop(plain, [rand(rng, (48, 32))] * 3, out_dtype="bfloat16")
    # the default output dtype: the plain operands' own (float32 for wgrad); bfloat16 for FP8
    w32 = [rand(rng, (48, 32)) for _ in range(3)]
    assert grouped_fprop(plain, w32).dtype == np.float32
    assert grouped_dgrad([rand(rng, (m, 48)).astype(np.float16) for m in (5, 0, 19)],
                         [w.astype(np.float16) for w in w32]).dtype == np.float16
    assert grouped_wgrad([p.astype(np.float16) for p in plain],
                         [rand(rng, (m, 48)).astype(np.float16) for m in (5, 0, 19)]).dtype == np.float32
    assert grouped_fprop(X, W).dtype == ml_dtypes.bfloat16
    with pytest.raises(TypeError, match="expected a GroupedFP8 or a list of 2-D arrays"):
        grouped_fprop(np.zeros((24, 32), np.float32), W)
    with pytest.raises(TypeError, match=r"x\[0\]: expected dtype bfloat16, float16 or float32"):
        grouped_fprop([np.zeros((2, 32), np.float64)], [np.zeros((16, 32), np.float64)])
    with pytest.raises(ValueError, match="x: fprop needs the rowwise FP8 copy"):
        grouped_fprop(dataclasses.replace(X, data=None), W)


def test_bias_checks(ops):
    X, W, _ = ops
    with pytest.raises(TypeError, match=r"^bias\[0\]: expected bfloat16, got float32 \(with FP8 "
                       r"operands and a float32 output, cuBLASLt's bias epilogue takes a bfloat16 "
                       r"bias\)$"):
        grouped_fprop(X, W, np.zeros((3, 48), np.float32), out_dtype="float32")
    for out_dtype, bias_dtype in (("bfloat16", np.float32), ("float16", ml_dtypes.bfloat16)):
        with pytest.raises(TypeError, match=rf"^bias\[0\]: expected {out_dtype}, got "
                           rf"{np.dtype(bias_dtype).name} \(cuBLASLt's bias epilogue takes a bias "
                           r"of the output dtype\)$"):
            grouped_fprop(X, W, np.zeros((3, 48), bias_dtype), out_dtype=out_dtype)
    rng = np.random.default_rng(0)          # plain operands: the output dtype too
    with pytest.raises(TypeError, match=r"^bias\[0\]: expected float32, got float16 \(cuBLASLt's"):
        grouped_fprop([rand(rng, (5, 32))], [rand(rng, (16, 32))], [np.zeros(16, np.float16)])
    with pytest.raises(ValueError, match=r"bias: expected an \(3, 48\) array"):
        grouped_fprop(X, W, np.zeros((48,), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"bias\[1\]: expected a contiguous \(48,\) vector"):
        grouped_fprop(X, W, [np.zeros(48, ml_dtypes.bfloat16), np.zeros(47, ml_dtypes.bfloat16),
                             np.zeros(48, ml_dtypes.bfloat16)])


def test_backends(ops):
    X, W, _ = ops
    with pytest.raises(ValueError, match="backend='emulate' is not available for the grouped GEMMs"):
        grouped_fprop(X, W, backend="emulate")
    with pytest.raises(ValueError, match=r"backend='cuda' needs device arrays .*got host arrays "
                       r"\(use backend='reference' to run the NumPy twin on the CPU\)$"):
        grouped_fprop(X, W, backend="cuda")        # not the casts' hint: no 'emulate' GEMMs
    with cugrouped.record_launches() as log:
        grouped_fprop(X, W, backend="reference")
    assert log == []


# ---------------------------------------------------------------------------------------------
# GPU: the cuBLASLt path against the reference.
#
# Tolerance. The reference is the exact product rounded once to the output dtype. cuBLASLt
# dequantizes exactly (the per-tensor scales factor out of the sum), accumulates the k products in
# fp32 -- on Hopper the FP8 tensor cores keep about 14 significant bits inside a block of the
# reduction before promoting to fp32 (DeepSeek-V3 §3.3.2), and fewer promotions with FAST_ACCUM --
# then rounds once to the output dtype. So elementwise
#     |ours - ref| <= ulp_out(ref)  +  2^-11 · Σ_j |a_j b_j|
# one ulp for the two roundings (ref's half ulp and ours), and 2^-11 of the absolute sum for the
# accumulation: a relative 2^-14 per partial sum, summed over the few (<= 3) promotion blocks of
# these k <= 160 tests with a 2x margin. Plain bf16/fp16 GEMMs accumulate in fp32: 2^-20 there.
# QuACK's rule is checked as well where it is meaningful (16-bit outputs, no fast accumulation): our
# max error vs the float64 reference is at most 2x that of CuPy's float32 matmul of the same
# dequantized inputs rounded to the output dtype.

def _host(g):
    import cupy

    dt = ml_dtypes.float8_e4m3fn if g.fp8_format == "e4m3" else ml_dtypes.float8_e5m2
    get = lambda a: None if a is None else cupy.asnumpy(a)  # noqa: E731
    data = get(g.data)
    return dataclasses.replace(g, data=None if data is None else data.view(dt), data_t=get(g.data_t),
                               amax=get(g.amax), scale=get(g.scale), scale_inv=get(g.scale_inv))


def _to_np(a, out_dtype):
    import cupy

    h = cupy.asnumpy(a)
    return h.view(NP_DTYPE[out_dtype]) if out_dtype == "bfloat16" else h


def _abs_sum(lefts, rights, form):
    """Σ_j |a_j b_j| per output element, float64."""
    pairs = [(np.abs(a), np.abs(b)) for a, b in zip(lefts, rights)]
    if form == "fprop":
        return np.concatenate([a @ b.T for a, b in pairs])
    if form == "dgrad":
        return np.concatenate([a @ b for a, b in pairs])
    return np.stack([a.T @ b for a, b in pairs])


# Accumulation error of cuBLASLt's FP8 GEMMs, relative to sum |a b|. Split accumulation (fp32
# partial sums, the default of dgrad and wgrad) stays well within ACC_EPS at these k. Hopper's
# fast accumulation (fprop's default) keeps about 14 bits in the tensor cores' accumulator between
# promotions (DeepSeek-V3 technical report, section 3.3), so its error grows with the k / 32
# steps of one accumulation: FAST_ACC_EPS covers k up to ~512 at 2^-14 a step.
ACC_EPS, FAST_ACC_EPS = 2**-11, 2**-9


def _assert_close(got, ref, abs_sum, out_dtype, acc_eps):
    g, r = np.asarray(got).astype(np.float64), np.asarray(ref).astype(np.float64)
    bound = 2 * half_ulp(r, out_dtype) + acc_eps * abs_sum
    err = np.abs(g - r)
    assert np.all(err <= bound), (f"max err/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}; "
                                  f"max err/sum|ab| {np.max(err / np.maximum(abs_sum, 1e-300)):.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(p))
def test_gpu_fp8_passes_vs_reference(split, pair):
    import cupy

    m_splits, k, n = SPLITS[split]
    w_fmt, x_fmt = pair
    g_fmt = "e4m3" if "e5m2" in pair else "e5m2"
    X, W, DY = make_fp8(m_splits, k, n, seed=len(split), x_fmt=x_fmt, w_fmt=w_fmt, g_fmt=g_fmt,
                        xp=cupy)
    hX, hW, hDY = _host(X), _host(W), _host(DY)
    xs, ws, dys = independent(hX, "rowwise"), independent(hW, "rowwise"), independent(hDY, "rowwise")
    for out_dtype in OUT_DTYPES:
        for fast in (True, False):
            y = grouped_fprop(X, W, out_dtype=out_dtype, fast_accum=fast)
            ref = grouped_fprop(hX, hW, out_dtype=out_dtype)
            _assert_close(_to_np(y, out_dtype), ref, _abs_sum(xs, ws, "fprop"), out_dtype,
                          FAST_ACC_EPS if fast else ACC_EPS)
        dx = grouped_dgrad(DY, W, out_dtype=out_dtype)
        ref = grouped_dgrad(hDY, hW, out_dtype=out_dtype)
        _assert_close(_to_np(dx, out_dtype), ref, _abs_sum(dys, ws, "dgrad"), out_dtype, ACC_EPS)
    dw = grouped_wgrad(X, DY)
    ref = grouped_wgrad(hX, hDY)
    _assert_close(cupy.asnumpy(dw), ref, _abs_sum(dys, xs, "wgrad"), "float32", ACC_EPS)
    if sum(m_splits) >= 64:
        # QuACK's rule on the bf16 output without fast accumulation, as RMS errors (stable over
        # the few thousand elements here, where a max would hinge on one rounding tie)
        y = _to_np(grouped_fprop(X, W, fast_accum=False), "bfloat16").astype(np.float64)
        exact = np.concatenate([x @ w.T for x, w in zip(xs, ws)])
        base = cupy.concatenate([cupy.asarray(x, dtype=cupy.float32)
                                 @ cupy.asarray(w, dtype=cupy.float32).T for x, w in zip(xs, ws)])
        base = cupy.asnumpy(base).astype(ml_dtypes.bfloat16).astype(np.float64)
        rms = lambda e: np.sqrt(np.mean(e * e))  # noqa: E731
        assert rms(y - exact) <= 2 * rms(base - exact)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["uniform", "skewed", "empty_first", "single", "count_one"])
@pytest.mark.parametrize("dtype,out_dtype", [("float16", "float16"), ("float16", "float32"),
                                             ("float32", "float32")])
def test_gpu_plain_passes_vs_reference(split, dtype, out_dtype):
    """Plain operands (CuPy has fp16/fp32; bf16 travels as GroupedFP8 or through torch)."""
    import cupy

    m_splits, k, n = SPLITS[split]
    k, n = k + 8, n + 8  # any size; keep 16-byte rows for speed
    rng = np.random.default_rng(3)
    xs = [rand(rng, (m, k)).astype(dtype) for m in m_splits]
    ws = [rand(rng, (n, k), 0.1).astype(dtype) for _ in m_splits]
    dys = [rand(rng, (m, n)).astype(dtype) for m in m_splits]
    d = lambda a: [cupy.asarray(v) for v in a]  # noqa: E731
    f = lambda a: [v.astype(np.float64) for v in a]  # noqa: E731
    eps = 2**-20
    y = grouped_fprop(d(xs), d(ws), out_dtype=out_dtype)
    _assert_close(cupy.asnumpy(y), grouped_fprop(xs, ws, out_dtype=out_dtype),
                  _abs_sum(f(xs), f(ws), "fprop"), out_dtype, eps)
    dx = grouped_dgrad(d(dys), d(ws), out_dtype=out_dtype)
    _assert_close(cupy.asnumpy(dx), grouped_dgrad(dys, ws, out_dtype=out_dtype),
                  _abs_sum(f(dys), f(ws), "dgrad"), out_dtype, eps)
    dw = grouped_wgrad(d(xs), d(dys), out_dtype=out_dtype)
    _assert_close(cupy.asnumpy(dw), grouped_wgrad(xs, dys, out_dtype=out_dtype),
                  _abs_sum(f(dys), f(xs), "wgrad"), out_dtype, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_gpu_bias(out_dtype):
    import cupy

    m_splits, k, n = [7, 0, 21, 40], 32, 48
    X, W, _ = make_fp8(m_splits, k, n, seed=5, xp=cupy)
    bdt = gg.bias_dtype_for(out_dtype, fp8=True)
    bias = np.random.default_rng(1).standard_normal((4, n)).astype(NP_DTYPE[bdt])
    dbias = cupy.asarray(bias.view(np.uint16) if bdt == "bfloat16" else bias)
    y = _to_np(grouped_fprop(X, W, dbias, out_dtype=out_dtype), out_dtype)
    hX, hW = _host(X), _host(W)
    ref = grouped_fprop(hX, hW, bias, out_dtype=out_dtype)
    xs, ws = independent(hX, "rowwise"), independent(hW, "rowwise")
    _assert_close(y, ref, _abs_sum(xs, ws, "fprop") + np.abs(np.concatenate(
        [np.broadcast_to(bias[i].astype(np.float64), (m, n)) for i, m in enumerate(m_splits)])),
        out_dtype, FAST_ACC_EPS)                         # fprop's default: fast accumulation


@pytest.mark.gpu
def test_gpu_wgrad_accumulate_into_main_grad():
    import cupy

    m_splits, k, n = [0, 33, 0, 16, 64], 32, 16
    X, _, DY = make_fp8(m_splits, k, n, seed=9, xp=cupy)
    rng = np.random.default_rng(2)
    before = [rand(rng, (n, k)) for _ in m_splits]
    main_grad = [cupy.asarray(b) for b in before]
    grouped_wgrad(X, DY, out=main_grad, accumulate=True)
    host = [b.copy() for b in before]
    grouped_wgrad(_host(X), _host(DY), out=host, accumulate=True)
    xs, dys = independent(_host(X), "columnwise"), independent(_host(DY), "columnwise")
    for i, m in enumerate(m_splits):
        got = cupy.asnumpy(main_grad[i])
        if m == 0:
            np.testing.assert_array_equal(got, before[i])
        else:
            _assert_close(got, host[i], np.abs(dys[i]).T @ np.abs(xs[i]) + np.abs(before[i]),
                          "float32", ACC_EPS)
    out = cupy.full((5, n, k), 7.0, cupy.float32)
    grouped_wgrad(X, DY, out=out)
    assert not cupy.asnumpy(out[0]).any() and not cupy.asnumpy(out[2]).any()


@pytest.mark.gpu
def test_gpu_launch_count_streams_and_out():
    """One cublasLtMatmul per non-empty expert; a non-default caller stream is honoured; out=
    buffers are written in place; more experts than side streams."""
    import cupy

    m_splits = [9, 0, 17, 0, 33, 1, 64, 2, 5, 0, 16]
    X, W, _ = make_fp8(m_splits, 32, 16, seed=7, xp=cupy)
    ref = grouped_fprop(_host(X), _host(W))
    out = cupy.zeros((sum(m_splits), 16), cupy.uint16)
    # the casts and the zero fill ran on the legacy default stream, which a non-blocking stream
    # does not wait for: finish them before handing their buffers to that stream
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, cugrouped.record_launches() as log:
        res = grouped_fprop(X, W, out=out)
    stream.synchronize()
    assert res is out
    # first the copy of each operand's (E,) scale_inv to 16-byte slots (cuBLASLt refuses the rest)
    assert [e.kernel for e in log] == (["cudaMemcpy2DAsync[scales]"] * 2
                                       + ["cublasLtMatmul"] * sum(1 for m in m_splits if m))
    xs, ws = independent(_host(X), "rowwise"), independent(_host(W), "rowwise")
    _assert_close(_to_np(out, "bfloat16"), ref, _abs_sum(xs, ws, "fprop"), "bfloat16",
                  FAST_ACC_EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("side", [1, 7, 16])
def test_gpu_side_stream_count_changes_no_bit(side):
    """The three passes over 1, 7 or 16 side streams (streams made on first use) give the bits
    of the default 4: each expert's GEMM is the same call on another stream."""
    run = _three_passes([9, 0, 17, 33, 1, 64, 2, 0, 5, 16, 40, 3, 8, 12, 7, 21, 30, 11], seed=8)
    want = run()
    with _side_streams(side):
        got = run()
    assert got == want


def _three_passes(m_splits, seed):
    """A function running fprop, dgrad and wgrad on the GPU over one set of FP8 operands,
    returning their outputs' bytes."""
    import cupy

    X, W, G = make_fp8(m_splits, 32, 16, seed=seed, xp=cupy)
    Wt = dataclasses.replace(W, data=None)
    return lambda: [cupy.asnumpy(a).tobytes() for a in (
        grouped_fprop(X, W), grouped_dgrad(G, Wt), grouped_wgrad(X, G))]


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [2, 4])
def test_gpu_host_threads_change_no_bit(threads):
    """The three passes with their cuBLASLt calls issued from 2 or 4 host threads (40 experts:
    enough calls for every thread) give the bits of the caller's thread alone, twice over (the
    workers made on the first call, reused on the second)."""
    run = _three_passes([9, 0, 17, 33, 1, 64, 2, 0, 5, 16, 40, 3, 8, 12, 7, 21, 30, 11, 4, 6] * 2,
                        seed=9)
    want = run()
    old = gg.set_host_threads(threads)
    try:
        assert [run(), run()] == [want, want]
    finally:
        gg.set_host_threads(old)


@pytest.mark.gpu
def test_gpu_loop_replays_in_a_cuda_graph():
    """The per-expert loop captured into a CUDA graph: the side streams forked from the capturing
    stream and joined back (more experts than side streams, empty experts skipped), workspaces
    and algorithms made by a warm-up call on that stream. Each replay over new operand bytes in
    the captured buffers gives what the eager call gives on them, within the FP8 tolerance; no
    replay leaves an expert's rows unwritten."""
    import cupy

    m_splits, k, n = [9, 0, 17, 33, 1, 64, 2, 0, 5, 16], 32, 16
    X, W, _ = make_fp8(m_splits, k, n, seed=11, xp=cupy)
    out = cupy.zeros((sum(m_splits), n), cupy.uint16)
    cupy.cuda.Device().synchronize()          # the casts ran on the legacy default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grouped_fprop(X, W, out=out, path="loop")        # warm-up: workspace, descriptors, algos
        stream.begin_capture()
        grouped_fprop(X, W, out=out, path="loop")
        graph = stream.end_capture()
    stream.synchronize()
    for seed in (12, 13):
        X2, W2, _ = make_fp8(m_splits, k, n, seed=seed, xp=cupy)
        for dst, src in ((X, X2), (W, W2)):
            for f in ("data", "data_t", "scale_inv"):
                getattr(dst, f)[...] = getattr(src, f)
        out.fill(0xFFFF)                      # a bfloat16 NaN wherever a replay writes nothing
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        xs, ws = independent(_host(X2), "rowwise"), independent(_host(W2), "rowwise")
        _assert_close(_to_np(out, "bfloat16"), grouped_fprop(_host(X2), _host(W2)),
                      _abs_sum(xs, ws, "fprop"), "bfloat16", FAST_ACC_EPS)


@pytest.mark.gpu
def test_gpu_misaligned_out_refused():
    import cupy

    X, W, _ = make_fp8([4, 4], 32, 16, seed=0, xp=cupy)
    buf = cupy.zeros(8 * 16 + 1, cupy.uint16)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        grouped_fprop(X, W, out=buf[1:].reshape(8, 16))


# ---------------------------------------------------------------------------------------------
# Per-call memo: keyed on everything the checks read; a hit is what a fresh check gives.

def _same_problem(p, q):
    for f in dataclasses.fields(p):
        a, b = getattr(p, f.name), getattr(q, f.name)
        if isinstance(a, (np.ndarray, gg.Blocks)) or isinstance(b, (np.ndarray, gg.Blocks)):
            if a is None or b is None or not np.array_equal(np.asarray(list(a), dtype=object),
                                                             np.asarray(list(b), dtype=object)):
                return False
        elif a != b:
            return False
    return True


def test_memo_hits_on_the_same_buffers_and_misses_on_any_change():
    gg.clear_memo()
    X, W, DY = make_fp8([5, 0, 19], 32, 48, seed=4)
    kw = dict(out_dtype="bfloat16", fast_accum=True)
    c1 = gg.checked("fprop", (X, W, None), kw)
    c2 = gg.checked("fprop", (X, W, None), kw)
    assert c2.problem is c1.problem and c2.outs is c1.outs
    assert _same_problem(c1.problem, gg.check_fprop(X, W))
    # a rebuilt GroupedFP8 over the same buffers hits too (the key is layout + addresses)
    assert gg.checked("fprop", (dataclasses.replace(X), W, None), kw).problem is c1.problem
    changed = [
        dataclasses.replace(X, scale_inv=np.asarray(X.scale_inv).copy()),      # new address
        dataclasses.replace(X, fp8_format="e5m2"),
        dataclasses.replace(X, data=np.asarray(X.data).copy()),                 # data address
    ]
    for X2 in changed:
        c = gg.checked("fprop", (X2, W, None), kw)
        assert c.problem is not c1.problem and _same_problem(c.problem, gg.check_fprop(X2, W))
    assert gg.checked("fprop", (X, W, None), dict(kw, fast_accum=False)).problem.fast_accum is False
    assert gg.checked("fprop", (X, W, None), dict(kw, out_dtype="float16")).problem.out_dtype == "float16"
    # an in-place reshape of a buffer (same object) is seen
    Y = dataclasses.replace(X, data=np.asarray(X.data).copy())
    gg.checked("fprop", (Y, W, None), kw)
    with warnings.catch_warnings():    # NumPy 2.5 deprecates setting .shape; users still can
        warnings.simplefilter("ignore", DeprecationWarning)
        Y.data.shape = (12, 64)
    with pytest.raises(ValueError, match=r"x.data: expected a contiguous \(24, 32\)"):
        gg.checked("fprop", (Y, W, None), kw)
    gg.clear_memo()


def test_memo_never_lets_bad_input_through():
    gg.clear_memo()
    X, W, DY = make_fp8([5, 0, 19], 32, 48, seed=4)
    grouped_fprop(X, W)                      # good call, memoised
    bad_splits = dataclasses.replace(X, m_splits=(5, 1, 19), m_pad_splits=(16, 16, 32))
    with pytest.raises(ValueError, match=r"x.data: expected a contiguous \(25, 32\)"):
        grouped_fprop(bad_splits, W)   # 25 rows in the counts, 24 in x.data
    with pytest.raises(TypeError, match="x is a GroupedFP8 but"):
        grouped_fprop(X, [np.zeros((48, 32), np.float32)] * 3)
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        grouped_wgrad(dataclasses.replace(X, fp8_format="e5m2"), DY)
    # device splits and unhashable fields are not keyed: the full check runs (and refuses)
    dev = dataclasses.replace(X, m_splits=np.array([5, 0, 19]), m_pad_splits=None)
    assert gg._call_key("fprop", (dev, W, None), {}) is None
    with pytest.raises(ValueError, match="token counts live on the device"):
        grouped_fprop(dev, W)
    assert gg._call_key("fprop", (dataclasses.replace(X, m_pad_splits=[16, 0, 32]), W, None), {}) is None
    gg.clear_memo()


def test_memo_plans_per_output_buffer():
    """The output part is keyed per buffer: another out (or a fresh one) gets its own plan, and
    a wrong out still raises after a right one was planned."""
    from cugrouped.bench.gemm import host_loop_state

    gg.clear_memo()
    st = host_loop_state()
    X, W, _ = make_fp8([5, 0, 19], 32, 48, seed=4)
    c = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
    out = np.empty((24, 48), ml_dtypes.bfloat16)
    _, b1, vp1 = gg.prepared_out(c, out, np)
    assert gg.prepared_out(c, out, np)[2] is vp1
    out2 = np.empty((24, 48), ml_dtypes.bfloat16)
    _, b2, vp2 = gg.prepared_out(c, out2, np)
    assert vp2 is not vp1 and int(b2.ptr[0]) == out2.ctypes.data
    new, _, vp3 = gg.prepared_out(c, None, np)
    assert new.shape == (24, 48) and int(vp3.ptrs[0, 3]) == new.ctypes.data
    with pytest.raises(ValueError, match=r"out: expected shape \(24, 48\)"):
        gg.prepared_out(c, np.empty((24, 32), ml_dtypes.bfloat16), np)
    assert gg.launch_checked(c, out, np, st) is out
    assert len(c.outs) <= gg.MEMO_OUTPUTS
    gg.clear_memo()


# ---------------------------------------------------------------------------------------------
# The grouped path on the CPU: the setup kernel (emulated) fills a host workspace and a fake
# grouped matmul reads it back; every group must be exactly the loop's call for that expert.

def _grouped_cpu_state():
    from cugrouped import cublaslt
    from cugrouped.bench.gemm import host_loop_state

    if not cublaslt.has_grouped_gemm():
        pytest.skip(NO_GROUPED_LIB)
    st = host_loop_state()
    st.cublas_version, st.has_grouped_symbol = 131000, True

    def alloc(n):
        buf = np.zeros(n + 16, np.uint8)
        off = (-buf.ctypes.data) % 16
        return buf[off:off + n]

    st.grouped = gg._GroupedState(alloc, setup_backend="emulate")
    st.caller_ws[0] = 0x7E0000000000     # cuBLAS workspace of the (fake) caller stream
    return st


def _read_groups(ws, groups):
    off, _ = gg.grouped_workspace_layout(groups)
    rd = lambda n, dt: np.frombuffer(ws[off[n]:off[n] + groups * np.dtype(dt).itemsize], dt).tolist()  # noqa: E731
    calls = []
    for g in range(groups):
        lay = {f"{x}_{d}": rd(f"{x}_{d}", np.int32)[g] for x in "abd" for d in ("rows", "cols", "ld")}
        calls.append(dict(a=rd("a", np.uint64)[g], b=rd("b", np.uint64)[g], c=rd("c", np.uint64)[g],
                          d=rd("d", np.uint64)[g], sa=rd("a_scale", np.uint64)[g],
                          sb=rd("b_scale", np.uint64)[g], **lay))
    alpha, beta = (float(np.frombuffer(ws[off[n]:off[n] + 4], np.float32)[0]) for n in ("alpha", "beta"))
    return calls, alpha, beta


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("split", ["uniform", "empty_middle", "skewed"])
def test_grouped_path_arrays_equal_the_loop_calls(pass_name, split):
    m_splits = {"uniform": [32, 16, 48, 64], "empty_middle": [16, 0, 48], "skewed": [3, 130, 1, 70]}[split]
    k, n = 32, 48
    X, W, DY = make_fp8(m_splits, k, n, seed=2)
    args = {"fprop": (X, W, None), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]
    kw = dict(out_dtype="float32" if pass_name == "wgrad" else "bfloat16", fast_accum=False)
    if pass_name == "wgrad":
        kw["accumulate"] = False
    st = _grouped_cpu_state()
    seen = []
    st.matmul = lambda *a: seen.append(a) or 0
    call = gg.checked(pass_name, args, kw)
    out, blocks, vp = gg.prepared_out(call, None, np)
    path, reason, spec = gg.path_for(call.problem, vp, blocks, st)
    if split == "skewed" and pass_name != "wgrad":   # 3 and 1 tokens: not 16 bytes
        assert path == "loop" and "multiple of 16" in reason
        return
    assert path == "grouped", reason
    with cugrouped.record_launches() as log:
        gg._launch_plan(vp, call.problem, blocks, st)
    assert [e.kernel for e in log] == ["cg::grouped_gemm_setup_kernel", "cublasLtMatmul[grouped]"]
    (args_,) = seen
    ws = st.grouped.workspaces[0]
    base = ws.ctypes.data
    off, _ = gg.grouped_workspace_layout(spec.groups)
    assert (args_[2], args_[3], args_[5], args_[7], args_[8], args_[10]) == (
        base + off["alpha"], base + off["a"], base + off["b"], base + off["beta"], base + off["c"],
        base + off["d"])
    groups, alpha, beta = _read_groups(ws, spec.groups)
    assert (alpha, beta) == (1.0, 0.0)
    loop = vp.calls()
    assert len(groups) == len(loop)
    for g, c in zip(groups, loop):
        assert (g["a"], g["b"], g["c"], g["d"]) == (c.a_ptr, c.b_ptr, c.d_ptr, c.d_ptr)
        assert (g["sa"], g["sb"]) == (c.a_scale_ptr, c.b_scale_ptr)
        assert (g["a"], g["a_rows"], g["a_cols"], g["a_ld"]) == (c.a_ptr, *c.a_layout[1:])
        assert (g["b_rows"], g["b_cols"], g["b_ld"]) == c.b_layout[1:]
        assert (g["d_rows"], g["d_cols"], g["d_ld"]) == c.d_layout[1:]
    assert gg.path_for(call.problem, vp, blocks, st, "loop")[0] == "loop"
    gg.clear_memo()


def test_grouped_path_refusals():
    st = _grouped_cpu_state()
    X, W, DY = make_fp8([16, 32, 48], 32, 48, seed=2)
    # separate main_grad buffers (3: two points are always evenly placed) unevenly spaced: loop
    # (or an error if the grouped path is requested)
    call = gg.checked("wgrad", (X, DY), dict(out_dtype="float32", fast_accum=False, accumulate=True))
    big = np.zeros((4, 48, 32), np.float32)
    main_grad = [big[0], big[2], big[1]]
    _, blocks, vp = gg.prepared_out(call, main_grad, np)
    path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
    assert path == "loop" and "evenly" in reason
    with pytest.raises(RuntimeError, match="path='grouped' cannot run"):
        gg.path_for(call.problem, vp, blocks, st, "grouped")
    st.cublas_version = 130300   # Hopper FP8 needs 13.5
    call = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
    _, blocks, vp = gg.prepared_out(call, None, np)
    assert gg.path_for(call.problem, vp, blocks, st)[0] == "loop"
    with pytest.raises(ValueError, match="path: got 'fast'"):
        grouped_fprop(X, W, path="fast")
    gg.clear_memo()


def test_only_wgrad_outputs_count_as_per_group_outputs():
    """The corrupting cuBLAS versions are avoided for per-group outputs (wgrad into separate
    main_grad buffers) only: fprop's one output array, unevenly split, still takes the grouped
    path there, while uneven main_grad buffers do not."""
    st = _grouped_cpu_state()
    st.cublas_version = 130800
    X, W, DY = make_fp8([16, 32, 48], 32, 48, seed=2)
    call = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
    _, blocks, vp = gg.prepared_out(call, None, np)
    assert gg.path_for(call.problem, vp, blocks, st)[:2] == ("grouped", "supported")
    call = gg.checked("wgrad", (X, DY), dict(out_dtype="float32", fast_accum=False,
                                             accumulate=True))
    big = np.zeros((4, 48, 32), np.float32)
    _, blocks, vp = gg.prepared_out(call, [big[0], big[2], big[1]], np)
    path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
    assert path == "loop" and "corrupts" in reason
    gg.clear_memo()


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["uniform", "empty_middle", "empty_first", "empty_last"])
@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
def test_gpu_grouped_vs_loop_vs_reference(split, pass_name):
    """Where this cuBLAS offers the grouped GEMM, it must give the loop's result (within the
    accumulation-order tolerance) and both the reference's; elsewhere the test says why not."""
    import cupy

    m_splits = {"uniform": [64, 64, 64, 64], "empty_middle": [32, 0, 96],
                "empty_first": [0, 48, 16], "empty_last": [80, 16, 0]}[split]
    k, n = 64, 48
    X, W, DY = make_fp8(m_splits, k, n, seed=11, xp=cupy)
    hX, hW, hDY = _host(X), _host(W), _host(DY)
    fn = {"fprop": grouped_fprop, "dgrad": grouped_dgrad, "wgrad": grouped_wgrad}[pass_name]
    dev = {"fprop": (X, W), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]
    host = {"fprop": (hX, hW), "dgrad": (hDY, hW), "wgrad": (hX, hDY)}[pass_name]
    odt = "float32" if pass_name == "wgrad" else "bfloat16"
    st = gg._state(cupy.cuda.Device().id)
    call = gg.checked(pass_name, dev, dict(out_dtype=odt, fast_accum=False, **(
        {"accumulate": False} if pass_name == "wgrad" else {})))
    _, blocks, vp = gg.prepared_out(call, None, cupy)
    path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
    if path != "grouped":
        pytest.skip(f"grouped GEMM not available here: {reason}")

    def nan_out():
        # NaN-filled outputs: beta is 0 (read from the device in the grouped call), so C = D must
        # not be read; a NaN left anywhere (C read, an expert not written) fails the comparison
        o = gg.new_output(call.problem, cupy)
        o.fill(0xFFFF if odt == "bfloat16" else np.nan)  # 0xFFFF: a bfloat16 NaN
        return o

    with cugrouped.record_launches() as log:
        g = fn(*dev, out=nan_out(), out_dtype=odt, fast_accum=False, path="grouped")
    assert "cublasLtMatmul[grouped]" in [e.kernel for e in log]
    lp = fn(*dev, out=nan_out(), out_dtype=odt, fast_accum=False, path="loop")
    ref = fn(*host, out_dtype=odt)
    xs, ws, dys = (independent(h, "rowwise") for h in (hX, hW, hDY))
    left, right = {"fprop": (xs, ws), "dgrad": (dys, ws), "wgrad": (dys, xs)}[pass_name]
    abs_sum = _abs_sum(left, right, pass_name)
    for got in (g, lp):
        _assert_close(_to_np(got, odt), ref, abs_sum, odt, ACC_EPS)


# ---------------------------------------------------------------------------------------------
# The launch's cuBLASLt calls executed on the CPU by a NumPy model of cublasLtMatmul.
#
# The model reads everything back from the real descriptors (through libcublasLt's getters) and
# from host memory at the addresses the op passes: column-major layouts (type, rows, cols, ld),
# TRANSA/TRANSB, pointer mode, alpha/beta, the A/B scale pointers (per-group pointer arrays in the
# grouped mode), the bias epilogue and its data type, grouped layouts' device arrays. It applies
# cuBLAS's rules (op(A) is m x k, op(B) k x n, D m x n, ld >= rows, FP8 only TN with 16-byte
# pointers and leading dimensions, fp32 compute and scale types, bias of m elements) and computes
# D = alpha * sa * sb * op(A) op(B) + beta * C (+ bias) in float64, rounded once. So the first
# GPU run can only differ from the reference by cuBLAS's accumulation, never by a mapping, ld,
# transpose, scale-pointer or pointer-array mistake.

_CUDA_NP = {E.CUDA_R_32F: np.dtype(np.float32), E.CUDA_R_16F: np.dtype(np.float16),
            E.CUDA_R_16BF: np.dtype(ml_dtypes.bfloat16),
            E.CUDA_R_8F_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
            E.CUDA_R_8F_E5M2: np.dtype(ml_dtypes.float8_e5m2)}


def _host_mem(ptr, nbytes):
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(int(ptr)))


def _attr(kind, handle, table, name):
    import ctypes

    from cugrouped import cublaslt

    attr, ctype = table[name]
    buf, written = ctype(), ctypes.c_size_t()
    status = getattr(cublaslt.lib(), f"cublasLt{kind}GetAttribute")(
        handle, attr, ctypes.byref(buf), ctypes.sizeof(buf), ctypes.byref(written))
    assert status == 0, (kind, name, status)
    return buf.value


def _col_major(ptr, dtype, rows, cols, ld):
    """The column-major ``rows x cols`` matrix at host address ``ptr`` (a writable view)."""
    assert ld >= max(rows, 1), f"ld {ld} < rows {rows}"
    isz = dtype.itemsize
    nbytes = ((cols - 1) * ld + rows) * isz if rows and cols else 0
    buf = _host_mem(ptr, nbytes).view(f"u{isz}")  # as_strided cannot take ml_dtypes' dtypes
    return np.lib.stride_tricks.as_strided(buf, shape=(rows, cols),
                                           strides=(isz, ld * isz)).view(dtype)


def _model_scales(ptr, mode, outer, k):
    """The factor cuBLAS applies to each element of an FP8 operand stored as ``outer`` rows of
    ``k`` (A: op(A)'s m rows; B: op(B)'s n columns), scale mode ``mode`` at host address ``ptr``:
    a scalar, or an ``(outer, k)`` array from the block layouts as grouped_block_fp8's docstring
    states them (counted here, not by cugrouped): VEC128_32F ``[c // 128, r]`` of
    ``(ceil(k / 128), roundup(outer, 4))``; BLK128x128_32F ``[r // 128, c // 128]`` of
    ``(ceil(outer / 128), roundup(ceil(k / 128), 4))``; VEC32_UE8M0 the byte ``2^(e - 127)`` of
    block ``c // 32`` of row ``r`` in 128 x 4 tiles of 512 bytes, row-major over the tiles (of
    ``roundup(ceil(k / 32), 4) / 4`` per tile row), ``(r % 32) * 16 + (r % 128) // 32 * 4 +
    (c // 32) % 4`` inside one. These layouts are the ones cugrouped states too: a GPU run, not
    this model, is what shows cuBLAS reads them so."""
    if mode in (E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
                E.CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F):
        return float(_host_mem(ptr, 4).view(np.float32)[0])
    assert ptr % 16 == 0, "block scales need 16-byte pointers"
    r = np.arange(outer)[:, None]
    c = np.arange(k)[None, :]
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if mode == E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
        rows = cdiv(outer, 4) * 4
        s = _host_mem(ptr, 4 * cdiv(k, 128) * rows).view(np.float32)
        return s[(c // 128) * rows + r].astype(np.float64)
    if mode == E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
        cols = cdiv(cdiv(k, 128), 4) * 4
        s = _host_mem(ptr, 4 * cdiv(outer, 128) * cols).view(np.float32)
        return s[(r // 128) * cols + c // 128].astype(np.float64)
    assert mode == E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0, mode
    tiles_per_row = cdiv(cdiv(k, 32), 4)
    s = _host_mem(ptr, 512 * cdiv(outer, 128) * tiles_per_row)
    cb = c // 32
    idx = ((r // 128) * tiles_per_row + cb // 4) * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + cb % 4
    return np.ldexp(1.0, s[idx].astype(np.int64) - 127)


def _model_matmul(calls):
    """A fake ``cublasLtMatmul`` (the launch's signature) that computes on host memory; each call's
    description is appended to ``calls``."""
    import ctypes

    from cugrouped.cublaslt import descriptors as D

    def desc_attr(h, name):
        return _attr("MatmulDesc", h, D.MATMUL_DESC_ATTRS, name)

    def lay_attr(h, name):
        return _attr("MatrixLayout", h, D.MATRIX_LAYOUT_ATTRS, name)

    def f32_at(ptr):
        return float(_host_mem(ptr, 4).view(np.float32)[0])

    def array_at(ptr, n, dt):
        return _host_mem(ptr, n * np.dtype(dt).itemsize).view(dt).tolist()

    def matmul(handle, desc, alpha, a, la, b, lb, beta, c, lc, d, ld_, algo, ws, ws_bytes, stream):
        h = lambda x: x.value if isinstance(x, ctypes.c_void_p) else x  # noqa: E731
        desc, la, lb, lc, ld_ = (h(x) for x in (desc, la, lb, lc, ld_))
        assert desc_attr(desc, "COMPUTE_TYPE") == E.CUBLAS_COMPUTE_32F
        assert desc_attr(desc, "SCALE_TYPE") == E.CUDA_R_32F
        ta, tb = desc_attr(desc, "TRANSA"), desc_attr(desc, "TRANSB")
        mode = desc_attr(desc, "POINTER_MODE")
        grouped = lay_attr(ld_, "BATCH_MODE") == E.CUBLASLT_BATCH_MODE_GROUPED
        for lay in (la, lb, lc):
            assert (lay_attr(lay, "BATCH_MODE") == E.CUBLASLT_BATCH_MODE_GROUPED) == grouped
        if mode == E.CUBLASLT_POINTER_MODE_HOST:
            assert not grouped
            al, be = alpha._obj.value, beta._obj.value     # ctypes.byref(c_float)
        else:
            assert mode == E.CUBLASLT_POINTER_MODE_DEVICE
            al, be = f32_at(alpha), f32_at(beta)
        types = [lay_attr(x, "TYPE") for x in (la, lb, lc, ld_)]
        assert types[2] == types[3], "C and D share a type"
        fp8 = types[0] in (E.CUDA_R_8F_E4M3, E.CUDA_R_8F_E5M2)
        sa_ptr, sb_ptr = desc_attr(desc, "A_SCALE_POINTER"), desc_attr(desc, "B_SCALE_POINTER")
        modes = (desc_attr(desc, "A_SCALE_MODE"), desc_attr(desc, "B_SCALE_MODE")) if fp8 else ()
        if fp8:
            block = [md not in (E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F,
                                E.CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F) for md in modes]
            assert block[0] == block[1], "block scales on both operands or neither"
            assert not block[0] or not desc_attr(desc, "FAST_ACCUM"), "no fast accumulation"
            if not grouped:
                assert E.CUBLASLT_MATMUL_MATRIX_SCALE_PER_BATCH_SCALAR_32F not in modes
            assert (ta, tb) == (E.CUBLAS_OP_T, E.CUBLAS_OP_N), "FP8 is TN only"
            assert types[1] in (E.CUDA_R_8F_E4M3, E.CUDA_R_8F_E5M2)
            assert not (types[0] == types[1] == E.CUDA_R_8F_E5M2)
            assert sa_ptr and sb_ptr
            if not grouped and not block[0] and (sa_ptr % 16 or sb_ptr % 16):
                return E.CUBLAS_STATUS_NOT_SUPPORTED   # as cuBLASLt 13.1 on an H200 answers
        else:
            assert types[0] == types[1] and not sa_ptr and not sb_ptr
        epi = desc_attr(desc, "EPILOGUE")
        assert epi in (E.CUBLASLT_EPILOGUE_DEFAULT, E.CUBLASLT_EPILOGUE_BIAS)
        bias_ptr = desc_attr(desc, "BIAS_POINTER") if epi == E.CUBLASLT_EPILOGUE_BIAS else 0
        if epi == E.CUBLASLT_EPILOGUE_BIAS:
            bias_type = desc_attr(desc, "BIAS_DATA_TYPE")
            want = E.CUDA_R_16BF if fp8 and types[3] == E.CUDA_R_32F else types[3]
            assert bias_type == want and bias_ptr
        if grouped:
            count = lay_attr(ld_, "BATCH_COUNT")
            for lay in (la, lb, lc):
                assert lay_attr(lay, "BATCH_COUNT") == count
                assert lay_attr(lay, "ROWS_COLS_ARRAY_INTEGER_WIDTH") == E.CUBLASLT_INTEGER_WIDTH_32
            dims = {x: [array_at(lay_attr(x, n), count, np.int32)
                        for n in ("ROWS_ARRAY", "COLS_ARRAY", "LD_ARRAY")] for x in (la, lb, lc, ld_)}
            ptrs = [array_at(p, count, np.uint64) for p in (a, b, c, d)]
            if fp8:
                assert E.CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F not in modes, "grouped: per group"
                sas, sbs = array_at(sa_ptr, count, np.uint64), array_at(sb_ptr, count, np.uint64)
            groups = [dict(ptr=[p[g] for p in ptrs],
                           lay=[tuple(v[g] for v in dims[x]) for x in (la, lb, lc, ld_)],
                           sa=sas[g] if fp8 else 0, sb=sbs[g] if fp8 else 0) for g in range(count)]
        else:
            lays = [tuple(lay_attr(x, n) for n in ("ROWS", "COLS", "LD")) for x in (la, lb, lc, ld_)]
            groups = [dict(ptr=[a, b, c, d], lay=lays, sa=sa_ptr, sb=sb_ptr)]
        for g in groups:
            pa, pb, pc, pd = (int(p) for p in g["ptr"])
            (ar, ac, ald), (br, bc, bld), (cr, cc, cld), (dr, dc, dld) = g["lay"]
            A = _col_major(pa, _CUDA_NP[types[0]], ar, ac, ald).astype(np.float64)
            B = _col_major(pb, _CUDA_NP[types[1]], br, bc, bld).astype(np.float64)
            opA = A.T if ta == E.CUBLAS_OP_T else A
            opB = B.T if tb == E.CUBLAS_OP_T else B
            m, k = opA.shape
            if fp8:   # TN: op(A) is A's m stored rows of k, op(B) B's n stored rows transposed
                opA = opA * _model_scales(int(g["sa"]), modes[0], m, k)
                opB = (opB.T * _model_scales(int(g["sb"]), modes[1], opB.shape[1], k)).T
            assert opB.shape[0] == k and (dr, dc) == (m, opB.shape[1]) == (cr, cc)
            if fp8:
                for p, isz, ldv in ((pa, 1, ald), (pb, 1, bld), (pd, _CUDA_NP[types[3]].itemsize, dld)):
                    assert p % 16 == 0 and (ldv * isz) % 16 == 0, "FP8 needs 16-byte pointers and lds"
            y = opA @ opB * al
            if be != 0:
                y = y + be * _col_major(pc, _CUDA_NP[types[2]], cr, cc, cld).astype(np.float64)
            if bias_ptr:
                bdt = _CUDA_NP[desc_attr(desc, "BIAS_DATA_TYPE")]
                y = y + _host_mem(bias_ptr, m * bdt.itemsize).view(bdt).astype(np.float64)[:, None]
            out = _col_major(pd, _CUDA_NP[types[3]], dr, dc, dld)
            out[...] = y.astype(out.dtype)
            calls.append(dict(grouped=grouped, m=m, n=opB.shape[1], k=k))
        return 0

    return matmul


def _model_close(got, ref, out_dtype):
    """Equal up to one rounding of the output (the model scales after summing, the reference
    before: an exact cancellation may leave a last-bit residue in one of them)."""
    g, r = np.asarray(got).astype(np.float64), np.asarray(ref).astype(np.float64)
    assert not np.isnan(g).any(), "an output element was never written"
    tol = 2 * half_ulp(r, out_dtype) + 2.0 ** -40 * np.abs(r).max(initial=0.0)
    assert np.all(np.abs(g - r) <= tol), f"max err/tol {np.max(np.abs(g - r) / tol):.3g}"


def _model_state(grouped=False):
    import ctypes

    st = _grouped_cpu_state() if grouped else __import__(
        "cugrouped.bench.gemm", fromlist=["host_loop_state"]).host_loop_state()
    if not grouped:
        st.cublas_version = 0
        st.caller_ws[0] = 0x7E0000000000  # a single expert runs on the (fake) caller stream
    calls = []
    st.matmul = _model_matmul(calls)
    st.memset = lambda ptr, nbytes, stream: ctypes.memset(int(ptr), 0, int(nbytes))
    scratch = []

    def scale_scratch(nbytes):
        scratch.append(np.empty(nbytes + 16, np.uint8))      # kept by the closure
        return -scratch[-1].ctypes.data % 16 + scratch[-1].ctypes.data

    def memcpy2d(dst, dpitch, src, spitch, width, height, stream):
        assert dpitch >= width and spitch >= width and dst % 16 == 0
        for i in range(height):
            ctypes.memmove(dst + i * dpitch, src + i * spitch, width)

    st.scale_scratch, st.memcpy2d = scale_scratch, memcpy2d
    return st, calls


def _model_cases():
    for pass_name in ("fprop", "dgrad", "wgrad"):
        for operands in ("e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2", "bfloat16", "float16", "float32"):
            yield pass_name, operands


def _model_operands(pass_name, operands, m_splits, k, n, seed):
    """(X, W, DY, k, n) for a model test: FP8 pairs ``"AxB"`` (the cuBLAS call's A and B formats)
    from the cast op, or plain arrays of one dtype (k and n grown by 8: not multiples of 16)."""
    if "x" in operands:
        a_fmt, b_fmt = operands.split("x")
        fmts = {"fprop": dict(w_fmt=a_fmt, x_fmt=b_fmt, g_fmt="e4m3"),
                "dgrad": dict(w_fmt=a_fmt, g_fmt=b_fmt, x_fmt="e4m3"),
                "wgrad": dict(x_fmt=a_fmt, g_fmt=b_fmt, w_fmt="e4m3")}[pass_name]
        return (*make_fp8(m_splits, k, n, seed=seed, **fmts), k, n)
    k, n = k + 8, n + 8
    rng = np.random.default_rng(seed)
    dt = NP_DTYPE[operands]
    X = [rand(rng, (m, k)).astype(dt) for m in m_splits]
    W = np.stack([rand(rng, (n, k), 0.1).astype(dt) for _ in m_splits])
    DY = [rand(rng, (m, n)).astype(dt) for m in m_splits]
    return X, W, DY, k, n


def _pass_call(pass_name, X, W, DY):
    """The op of ``pass_name`` and its operands among X, W, DY."""
    fn = {"fprop": grouped_fprop, "dgrad": grouped_dgrad, "wgrad": grouped_wgrad}[pass_name]
    return fn, {"fprop": (X, W), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]


@pytest.mark.parametrize("pass_name,operands", list(_model_cases()))
@pytest.mark.parametrize("split", ["skewed", "empty_first", "empty_last", "single"])
def test_loop_calls_computed_by_a_cublaslt_model_equal_the_reference(split, pass_name, operands):
    from cugrouped.cublaslt import descriptors as D

    gg.clear_memo()
    m_splits, k, n = SPLITS[split]
    fp8 = "x" in operands
    X, W, DY, k, n = _model_operands(pass_name, operands, m_splits, k, n, seed=21)
    if fp8:
        outs = OUT_DTYPES if pass_name != "wgrad" else ("float32", "bfloat16")
    else:
        outs = {"bfloat16": ("bfloat16", "float32"), "float16": ("float16", "float32"),
                "float32": ("float32",)}[operands]
    fn = {"fprop": grouped_fprop, "dgrad": grouped_dgrad, "wgrad": grouped_wgrad}[pass_name]
    args = {"fprop": (X, W), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]
    st, calls = _model_state()
    for out_dtype in outs:
        for bias in ((False, True) if pass_name == "fprop" else (False,)):
            extra = ()
            if bias:
                bdt = gg.bias_dtype_for(out_dtype, fp8)
                extra = (np.random.default_rng(3).standard_normal((len(m_splits), n))
                         .astype(NP_DTYPE[bdt]),)
            kw = dict(out_dtype=out_dtype)
            call = gg.checked(pass_name, args + extra, dict(
                kw, fast_accum=False, **({"accumulate": False} if pass_name == "wgrad" else {})))
            out = gg.new_output(call.problem, np)
            out[...] = np.nan if out.dtype.kind == "f" else 0
            calls.clear()
            gg.launch_checked(call, out, np, st, "loop")
            assert len(calls) == sum(1 for m in m_splits if m), calls
            ref = np.asarray(fn(*args, *extra, out_dtype=out_dtype, backend="reference"))
            _model_close(out, ref, out_dtype)
    # a strided output (row stride > columns): D's ld is the row stride; the gap is not written
    call = gg.checked(pass_name, args, dict(out_dtype="float32", fast_accum=False, **(
        {"accumulate": False} if pass_name == "wgrad" else {})))
    shape = gg.new_output(call.problem, np).shape
    big = np.full(shape[:-1] + (shape[-1] + 16,), np.nan, np.float32)
    strided = big[..., :shape[-1]]
    gg.launch_checked(call, strided if pass_name != "wgrad" else list(strided), np, st, "loop")
    _model_close(strided, fn(*args, out_dtype="float32", backend="reference"), "float32")
    assert np.isnan(big[..., shape[-1]:]).all()
    if pass_name == "wgrad":  # accumulate into main_grad (beta = 1, C = D), empty experts untouched
        rng = np.random.default_rng(8)
        before = [rand(rng, (n, k)) for _ in m_splits]
        got, want = [b.copy() for b in before], [b.copy() for b in before]
        gg.launch_checked(gg.checked("wgrad", args, dict(out_dtype="float32", fast_accum=False,
                                                           accumulate=True)), got, np, st, "loop")
        grouped_wgrad(*args, out=want, accumulate=True, backend="reference")
        for g_, w_ in zip(got, want):
            _model_close(g_, w_, "float32")
    gg.clear_memo()
    D.clear_caches()


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("split", ["uniform", "empty_middle"])
def test_grouped_call_computed_by_a_cublaslt_model_equals_the_reference(split, pass_name):
    """The grouped path end to end on the CPU: the emulated setup kernel fills the workspace, the
    model reads the grouped layouts' device arrays, pointer arrays and per-group scale pointers."""
    gg.clear_memo()
    m_splits = {"uniform": [32, 16, 48, 64], "empty_middle": [16, 0, 48]}[split]
    k, n = 32, 48
    X, W, DY = make_fp8(m_splits, k, n, seed=2)
    fn = {"fprop": grouped_fprop, "dgrad": grouped_dgrad, "wgrad": grouped_wgrad}[pass_name]
    args = {"fprop": (X, W), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]
    odt = "float32" if pass_name == "wgrad" else "bfloat16"
    st, calls = _model_state(grouped=True)
    call = gg.checked(pass_name, args, dict(out_dtype=odt, fast_accum=False, **(
        {"accumulate": False} if pass_name == "wgrad" else {})))
    out = gg.new_output(call.problem, np)
    out[...] = np.nan
    gg.launch_checked(call, out, np, st, "grouped")
    assert calls and all(c["grouped"] for c in calls)
    assert len(calls) == sum(1 for m in m_splits if m)
    _model_close(out, np.asarray(fn(*args, out_dtype=odt, backend="reference")), odt)
    gg.clear_memo()


def test_grouped_pointers_and_lds_must_be_16_bytes_for_every_dtype():
    """The grouped call's pointers live on the device, where cuBLAS cannot check them: a 16-bit
    operand the checks accept (2-byte aligned, a slice) goes to the loop, saying why."""
    kw = dict(version=131000, compute_capability=90, has_symbol=True, discrete_out=False)
    k, n = 32, 48
    rng = np.random.default_rng(4)
    ws = [rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16) for _ in range(3)]
    xs = [rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16) for m in (16, 32, 48)]
    p = gg.check_fprop(xs, ws)
    _, blocks = gg.outputs(p, None, np)
    assert gg.choose_path(p, gg.plan_arrays(p, blocks), **kw) == ("grouped", "supported")
    buf = np.zeros(32 * k + 1, ml_dtypes.bfloat16)
    xs[1] = buf[1:].reshape(32, k)                              # 2 bytes past 16-byte alignment
    p = gg.check_fprop(xs, ws)
    _, blocks = gg.outputs(p, None, np)
    path, why = gg.choose_path(p, gg.plan_arrays(p, blocks), **kw)
    assert path == "loop" and "not 16-byte aligned" in why


@pytest.mark.parametrize("refusal", ["heuristic", "matmul"])
def test_a_grouped_call_cublas_refuses_runs_as_the_loop(refusal):
    """cuBLAS turning the grouped call down (the heuristic finds no algorithm, or the call says
    NOT_SUPPORTED) runs the loop, right, and is remembered: a new plan of the same shape does
    not ask again. ``path="grouped"`` raises instead."""
    from cugrouped.cublaslt import CublasLtError

    gg.clear_memo()
    m_splits, k, n = [16, 32, 48], 32, 48
    X, W, _ = make_fp8(m_splits, k, n, seed=3)
    st, calls = _model_state(grouped=True)
    asked = []
    if refusal == "heuristic":
        real = st.heuristic

        def heuristic(desc, la, lb, ld, pref, what):
            if what.startswith("grouped"):
                asked.append(what)
                raise CublasLtError("cublasLtMatmulAlgoGetHeuristic", 15, f"no algorithm for {what}")
            return real(desc, la, lb, ld, pref, what)
        st.heuristic = heuristic
    else:
        model = st.matmul

        def matmul(handle, desc, alpha, *a):
            if isinstance(alpha, int):            # the grouped call: a device alpha pointer
                asked.append(desc)
                return E.CUBLAS_STATUS_NOT_SUPPORTED
            return model(handle, desc, alpha, *a)
        st.matmul = matmul
    ref = np.asarray(grouped_fprop(X, W, out_dtype="bfloat16", backend="reference"))
    for _ in range(2):
        gg.clear_memo()                       # a new plan each time, the same shape
        call = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
        out = gg.new_output(call.problem, np)
        out[...] = np.nan
        with cugrouped.record_launches() as log:
            gg.launch_checked(call, out, np, st)
        _model_close(out, ref, "bfloat16")
        assert [e.kernel for e in log].count("cublasLtMatmul") == 3
    assert len(asked) == 1 and calls and not any(c["grouped"] for c in calls)
    _, blocks, vp = gg.prepared_out(call, out, np)
    path, why, _ = gg.path_for(call.problem, vp, blocks, st)
    assert path == "loop" and "cuBLAS refused the grouped call" in why
    gg.clear_memo()
    call = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
    with pytest.raises(RuntimeError, match="path='grouped' cannot run: .*(no algorithm|NOT_SUPP)"):
        gg.launch_checked(call, gg.new_output(call.problem, np), np, st, "grouped")
    gg.clear_memo()


def test_a_grouped_heuristic_error_that_is_not_a_refusal_is_raised():
    """Only NOT_SUPPORTED (what "no algorithm" is) sends a grouped call to the loop: another
    status (a descriptor cuBLAS calls invalid) is a mistake to see, not to hide, and is not
    remembered."""
    from cugrouped.cublaslt import CublasLtError

    gg.clear_memo()
    X, W, _ = make_fp8([16, 32, 48], 32, 48, seed=3)
    st, calls = _model_state(grouped=True)
    st.heuristic = lambda desc, la, lb, ld, pref, what: (_ for _ in ()).throw(
        CublasLtError("cublasLtMatmulAlgoGetHeuristic", E.CUBLAS_STATUS_INVALID_VALUE, what))
    call = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
    with pytest.raises(CublasLtError, match="INVALID_VALUE"):
        gg.launch_checked(call, gg.new_output(call.problem, np), np, st)
    assert not st.grouped.refused and not calls
    gg.clear_memo()


def test_a_plan_launched_again_is_one_matmul_on_its_own_arrays(monkeypatch):
    """The same plan again (same counts and buffers): its second launch fills a workspace of its
    own, later ones are the matmul alone, on those arrays; a new stream fills them once more;
    right every time. Past the cap a plan stays on the shared workspace."""
    from cugrouped.ops import _gemm_grouped

    gg.clear_memo()
    m_splits = [16, 0, 48, 32]
    X, W, _ = make_fp8(m_splits, 32, 48, seed=6)
    st, calls = _model_state(grouped=True)
    ref = np.asarray(grouped_fprop(X, W, out_dtype="bfloat16", backend="reference"))
    call = gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16", fast_accum=True))
    out = gg.new_output(call.problem, np)
    bases, setups = [], []
    real_matmul = st.matmul

    def matmul(handle, desc, alpha, *a):
        bases.append(alpha)
        return real_matmul(handle, desc, alpha, *a)
    st.matmul = matmul
    stream = [st.current_stream()]
    first = stream[0].ptr
    st.current_stream = lambda: stream[0]
    st.caller_ws[0x4242] = st.caller_ws[first]       # the other stream's cuBLAS workspace
    for i in range(5):
        if i == 3:
            stream[0] = type(stream[0])(0x4242)     # another caller stream
        out[...] = np.nan
        with cugrouped.record_launches() as log:
            gg.launch_checked(call, out, np, st)
        setups.append(sum("grouped_gemm_setup" in e.kernel for e in log))
        _model_close(out, ref, "bfloat16")
    off, _ = gg.grouped_workspace_layout(3)
    shared = st.grouped.workspaces[first]
    own = st.grouped.owned
    assert len(own) == 1 and setups == [1, 1, 0, 1, 0]
    assert bases[0] == shared.ctypes.data + off["alpha"]
    assert bases[1:] == [own[0].ctypes.data + off["alpha"]] * 4
    assert all(c["grouped"] for c in calls) and len(calls) == 5 * 3
    # the cap: another plan launched twice keeps to the shared workspace
    monkeypatch.setattr(_gemm_grouped, "OWN_WORKSPACES_MAX", 1)
    X2, W2, _ = make_fp8([32, 16], 32, 48, seed=7)
    call2 = gg.checked("fprop", (X2, W2, None), dict(out_dtype="bfloat16", fast_accum=True))
    out2 = gg.new_output(call2.problem, np)
    for _ in range(3):
        with cugrouped.record_launches() as log:
            gg.launch_checked(call2, out2, np, st)
        assert sum("grouped_gemm_setup" in e.kernel for e in log) == 1
    assert len(st.grouped.owned) == 1
    gg.clear_memo()


def test_the_grouped_descriptor_cache_is_bounded(monkeypatch):
    from cugrouped.ops import _gemm_grouped

    monkeypatch.setattr(_gemm_grouped, "GROUPED_CALLS_CACHED", 2)
    gg.clear_memo()
    st, calls = _model_state(grouped=True)
    for m_splits in ([16, 32], [32, 48], [48, 64], [64, 80]):     # four average shapes
        X, W, _ = make_fp8(m_splits, 32, 48, seed=5)
        grouped_out = gg.new_output(gg.check_fprop(X, W), np)
        gg.launch_checked(gg.checked("fprop", (X, W, None), dict(out_dtype="bfloat16",
                                                                  fast_accum=True)),
                          grouped_out, np, st)
        assert len(st.grouped.calls) <= 2
    assert sum(c["grouped"] for c in calls) == 4 * 2
    gg.clear_memo()


CALLER = 0x42                     # the caller's stream; side streams are 0x1000 + i


def _streams_logged():
    """The loop's host state with side streams and events that log what they are asked:
    ``("record", stream)`` for an event recorded on a stream, ``("wait", stream)`` for a stream
    made to wait on an event."""
    from cugrouped.bench.gemm import host_loop_state

    log = []

    class Ev:
        def record(self, stream=None):
            log.append(("record", stream.ptr))

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def wait_event(self, ev):
            log.append(("wait", self.ptr))

    st = host_loop_state()
    st.streams = [Stream(0x1000 + i) for i in range(gg.NUM_STREAMS)]
    st.stream_ptrs = [s.ptr for s in st.streams]
    st.fork_event, st.done_events = Ev(), [Ev() for _ in st.streams]
    st.make_event = Ev
    st.make_side_stream = lambda: (Stream(0x1000 + len(st.streams)), 0x7E0000000000 + len(st.streams))
    caller = Stream(CALLER)
    st.current_stream = lambda: caller
    return st, log


def test_loop_joins_the_side_streams_even_when_an_expert_fails():
    """A failing expert (here: no algorithm for its shape) raises, but the experts already
    launched on the side streams are still joined back into the caller's stream."""
    from cugrouped.cublaslt import CublasLtError, HeuristicResult

    st, log = _streams_logged()
    seen = []

    def heuristic(desc, la, lb, ld, pref, what):
        if len(seen) == 2:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic", 15, what)
        return HeuristicResult()

    st.heuristic = heuristic
    st.matmul = lambda *a: seen.append(a) or 0
    X, W, _ = make_fp8([16, 32, 48, 64], 32, 16, seed=1)  # four shapes: a heuristic per expert
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    with pytest.raises(CublasLtError):
        gg._launch_plan(gg.plan_arrays(p, blocks), p, blocks, st)
    assert len(seen) == 2
    assert log[0] == ("record", CALLER)                        # fork on the caller
    waits = [i for i, e in enumerate(log) if e == ("wait", CALLER)]
    assert len(waits) == gg.NUM_STREAMS                        # joined back, every side stream
    gg.clear_memo()


@pytest.mark.parametrize("live", [2, 3, 4, 6])
def test_loop_forks_exactly_the_side_streams_it_joins(live):
    """With fewer experts than side streams, only the streams that run an expert are forked from
    the caller's stream, and each of them is joined back: a stream forked and never joined
    makes a CUDA graph capture fail at its end (cudaErrorStreamCaptureUnjoined)."""
    st, log = _streams_logged()
    used_streams = []
    st.matmul = lambda *a: used_streams.append(a[-1]) or 0
    X, W, _ = make_fp8([16] * live + [0], 32, 16, seed=2)   # an empty expert runs no call
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    gg._launch_plan(gg.plan_arrays(p, blocks), p, blocks, st)
    n = min(live, gg.NUM_STREAMS)
    assert len(used_streams) == live and set(used_streams) == {0x1000 + i for i in range(n)}
    forked = [ptr for what, ptr in log if what == "wait" and ptr != CALLER]
    joined = [ptr for what, ptr in log if what == "record" and ptr != CALLER]
    assert sorted(forked) == sorted(joined) == [0x1000 + i for i in range(n)]
    assert log[0] == ("record", CALLER) and log.count(("wait", CALLER)) == n
    gg.clear_memo()


@pytest.mark.parametrize("side,live", [(1, 3), (6, 8), (8, 5), (32, 40)])
def test_loop_spreads_over_the_side_streams_set_making_more_on_first_use(side, live):
    """set_side_streams(n): expert j's call goes to side stream j % n, with that stream's
    workspace; streams beyond those made are made (with a workspace and a join event) before
    the fork, and exactly the streams used are forked and joined."""
    st, log = _streams_logged()
    calls = []
    st.matmul = lambda *a: calls.append((a[-1], a[-3])) or 0        # (stream, workspace)
    X, W, _ = make_fp8([16] * live, 32, 16, seed=3)
    p = gg.check_fprop(X, W)
    _, blocks = gg.outputs(p, None, np)
    with _side_streams(side):
        gg._launch_plan(gg.plan_arrays(p, blocks), p, blocks, st)
    n = min(side, live)
    # all the streams set are made at once (a later captured call must find them), else none
    assert len(st.streams) == len(st.stream_ptrs) == len(st.ws_ptrs) == len(st.done_events) \
        == (side if n > gg.NUM_STREAMS else gg.NUM_STREAMS)
    assert [s for s, _ in calls] == [0x1000 + j % n for j in range(live)]
    assert [w for _, w in calls] == [st.ws_ptrs[j % n] for j in range(live)]
    forked = [ptr for what, ptr in log if what == "wait" and ptr != CALLER]
    joined = [ptr for what, ptr in log if what == "record" and ptr != CALLER]
    assert sorted(forked) == sorted(joined) == [0x1000 + i for i in range(n)]
    assert log[0] == ("record", CALLER) and log.count(("wait", CALLER)) == n
    gg.clear_memo()


@contextlib.contextmanager
def _side_streams(n):
    """``set_side_streams(n)`` for the block, the count found put back after."""
    old = gg.set_side_streams(n)
    try:
        yield
    finally:
        assert gg.set_side_streams(old) == n


def _six_expert_fprop(seed):
    """A six-expert fprop's checked problem and output blocks (six side streams' worth)."""
    X, W, _ = make_fp8([16] * 6, 32, 16, seed=seed)
    p = gg.check_fprop(X, W)
    return p, gg.outputs(p, None, np)[1]


def test_a_side_stream_half_made_leaves_the_lists_in_step():
    """A maker that raises (an allocation refused inside a graph capture, say) adds nothing: the
    next call still forks and joins matching streams and events."""
    st, log = _streams_logged()
    make = st.make_event

    def failing():
        raise RuntimeError("no event")

    st.make_event = failing
    p, blocks = _six_expert_fprop(5)
    with _side_streams(6):
        with pytest.raises(RuntimeError, match="no event"):
            gg._launch_plan(gg.plan_arrays(p, blocks), p, blocks, st)
        assert log == [] and len(st.streams) == len(st.ws_ptrs) == len(st.done_events) == 4
        st.make_event = make
        gg._launch_plan(gg.plan_arrays(p, blocks), p, blocks, st)
    assert len(st.streams) == len(st.done_events) == 6 and log.count(("wait", CALLER)) == 6
    gg.clear_memo()


def test_side_streams_that_cannot_be_made_are_refused_before_the_fork():
    st, log = _streams_logged()
    st.make_side_stream = None
    p, blocks = _six_expert_fprop(4)
    with _side_streams(6), pytest.raises(RuntimeError, match="6 side streams asked for, 4 made"):
        gg._launch_plan(gg.plan_arrays(p, blocks), p, blocks, st)
    assert log == []                                            # nothing forked
    gg.clear_memo()


@pytest.mark.parametrize("n", [0, -2, 33, 4.0, False, "4", None])
def test_set_side_streams_refuses_what_the_loop_cannot_use(n):
    with pytest.raises(ValueError, match=r"n: expected an int in \[1, 32\]"):
        gg.set_side_streams(n)
    assert gg.side_streams() == gg.NUM_STREAMS


# ---------------------------------------------------------------------------------------------
# CUDA torch tensors, on the CPU. The ops read torch tensors through their pointers, shapes,
# strides and dtypes (as_view), so torch CPU tensors over host memory, made to report device 0,
# take exactly the CUDA path a CUDA tensor takes: the op's backend choice and device scope, the
# memo, the checks, the plan and the cuBLASLt calls, run by the NumPy model of cublasLtMatmul
# above; the torch layer's custom ops are run the same way with their CUDA branch.

def _torch_cpu(a):
    """A torch CPU tensor over the memory of NumPy array ``a``: FP8 as its uint8 bytes (as the
    torch layer passes it), bfloat16 as ``torch.bfloat16``, other dtypes as they are."""
    import torch

    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype.itemsize == 1:
        return torch.from_numpy(a.view(np.uint8))
    return torch.from_numpy(a)


def _torch_operand(op):
    if isinstance(op, cugrouped.GroupedFP8):
        conv = lambda a: None if a is None else _torch_cpu(a)  # noqa: E731
        return dataclasses.replace(op, data=conv(op.data), data_t=conv(op.data_t), amax=conv(op.amax),
                                   scale=conv(op.scale), scale_inv=conv(op.scale_inv))
    if isinstance(op, (list, tuple)):
        return [_torch_cpu(a) for a in op]
    return _torch_cpu(op)


@pytest.fixture
def torch_on_device(monkeypatch):
    """Torch tensors seen by the GEMM ops as CUDA tensors on device 0 (NumPy arrays stay host
    arrays); ``_run``'s device scope and per-device state replaced by a recorder and the cuBLASLt
    model. Yields ``(states, scopes, kinds)``: the states by path, the device scopes entered, and
    the array kinds the checks were given."""
    torch = pytest.importorskip("torch")
    import contextlib

    from cugrouped.ops import _gemm_checks

    real = _gemm_checks.as_view
    kinds = set()

    def as_view(x, **kw):
        v = real(x, **kw)
        kinds.add(v.kind)
        return dataclasses.replace(v, device=0) if v.kind == "torch" else v

    monkeypatch.setattr(_gemm_checks, "as_view", as_view)
    from cugrouped import cublaslt

    states = {"loop": _model_state()}
    if cublaslt.has_grouped_gemm():
        states["grouped"] = _model_state(grouped=True)
    use = {"path": "loop"}
    monkeypatch.setattr(gg, "_state", lambda device: states[use["path"]][0])
    scopes = []
    monkeypatch.setattr(_launch, "device_scope",
                        lambda backend, device: scopes.append(device) or contextlib.nullcontext())
    # the torch front: torch's stream made current (a no-op here), new outputs on the CPU
    from cugrouped.pytorch import functional

    monkeypatch.setattr(functional, "launch_context", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(functional, "_gemm_device", lambda problem: torch.device("cpu"))
    gg.clear_memo()
    yield states, scopes, kinds, use
    gg.clear_memo()
    from cugrouped.cublaslt import descriptors as D

    D.clear_caches()


def _nan_like_out(problem_shape, out_dtype):
    return np.full(problem_shape, np.nan, NP_DTYPE[out_dtype])


_TORCH_CASES = [(p, o) for p in ("fprop", "dgrad", "wgrad")
                for o in ("e4m3xe4m3", "e5m2xe4m3", "bfloat16", "float32")]


@pytest.mark.parametrize("pass_name,operands", _TORCH_CASES)
@pytest.mark.parametrize("split", ["skewed", "empty_first"])
def test_torch_tensors_take_the_cuda_path_to_the_reference(torch_on_device, split, pass_name,
                                                           operands):
    """fprop/dgrad/wgrad on torch tensors through the op (backend chosen from the tensors' device,
    device scope, memo, checks, plan, loop of cuBLASLt calls run by the model): bias, stacked
    and per-expert outputs, accumulation into a list of main_grad tensors."""
    states, scopes, kinds, _ = torch_on_device
    st, calls = states["loop"]
    m_splits, k, n = SPLITS[split]
    fp8 = "x" in operands
    X, W, DY, k, n = _model_operands(pass_name, operands, m_splits, k, n, seed=31)
    out_dtype = ("bfloat16" if pass_name != "wgrad" else "float32") if fp8 else "float32"
    fn, host = _pass_call(pass_name, X, W, DY)
    dev = tuple(_torch_operand(a) for a in host)
    ref = np.asarray(fn(*host, out_dtype=out_dtype, backend="reference"))
    out = _nan_like_out(ref.shape, out_dtype)
    calls.clear()
    kinds.clear()
    assert fn(*dev, out=_torch_cpu(out), out_dtype=out_dtype) is not None
    assert len(calls) == sum(1 for m in m_splits if m)
    _model_close(out, ref, out_dtype)
    assert scopes and set(scopes) == {0} and kinds == {"torch"}
    if pass_name == "fprop":            # bias: (E, n) tensor and a list of (n,) tensors
        bdt = gg.bias_dtype_for(out_dtype, fp8)
        bias = np.random.default_rng(3).standard_normal((len(m_splits), n)).astype(NP_DTYPE[bdt])
        ref_b = np.asarray(fn(*host, bias, out_dtype=out_dtype, backend="reference"))
        for b in (_torch_cpu(bias), [_torch_cpu(v) for v in bias]):
            out[...] = np.nan
            fn(*dev, b, out=_torch_cpu(out), out_dtype=out_dtype)
            _model_close(out, ref_b, out_dtype)
    if pass_name == "wgrad":            # per-expert outputs; accumulate into main_grad tensors
        outs = [np.full((n, k), np.nan, NP_DTYPE[out_dtype]) for _ in m_splits]
        fn(*dev, out=[_torch_cpu(o) for o in outs], out_dtype=out_dtype)
        _model_close(np.stack(outs), ref, out_dtype)
        rng = np.random.default_rng(8)
        got = [rand(rng, (n, k)) for _ in m_splits]
        want = [g.copy() for g in got]
        fn(*dev, out=[_torch_cpu(g) for g in got], accumulate=True)
        fn(*host, out=want, accumulate=True, backend="reference")
        for g_, w_ in zip(got, want):
            _model_close(g_, w_, "float32")


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
def test_torch_tensors_take_the_grouped_path(torch_on_device, pass_name):
    """The grouped GEMM (emulated setup kernel, model of the grouped call) on torch tensors."""
    states, _, _, use = torch_on_device
    if "grouped" not in states:
        pytest.skip(NO_GROUPED_LIB)
    use["path"] = "grouped"
    _, calls = states["grouped"]
    m_splits, k, n = [32, 16, 48, 64], 32, 48
    X, W, DY = make_fp8(m_splits, k, n, seed=2)
    fn = {"fprop": grouped_fprop, "dgrad": grouped_dgrad, "wgrad": grouped_wgrad}[pass_name]
    host = {"fprop": (X, W), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]
    odt = "float32" if pass_name == "wgrad" else "bfloat16"
    ref = np.asarray(fn(*host, out_dtype=odt, backend="reference"))
    out = _nan_like_out(ref.shape, odt)
    with cugrouped.record_launches() as log:
        fn(*(_torch_operand(a) for a in host), out=_torch_cpu(out), out_dtype=odt, path="grouped")
    assert "cublasLtMatmul[grouped]" in [e.kernel for e in log]
    assert calls and all(c["grouped"] for c in calls)
    _model_close(out, ref, odt)


def test_torch_tensor_refusals(torch_on_device):
    """One kind per call; accumulation needs the gradients to add into."""
    import torch

    X, W, DY = make_fp8([5, 0, 19], 32, 48, seed=0)
    Xt, Wt, DYt = (_torch_operand(a) for a in (X, W, DY))
    with pytest.raises(ValueError, match="accumulate=True adds into existing gradients"):
        grouped_wgrad(Xt, DYt, accumulate=True)
    with pytest.raises(ValueError, match="out: must be a torch array on the operands' device"):
        grouped_fprop(Xt, Wt, out=np.empty((24, 48), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="must be arrays of the same kind on the same device"):
        grouped_fprop(X, Wt, out=torch.empty((24, 48), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: mixes a torch array on device 0 with a numpy array"):
        grouped_fprop(dataclasses.replace(Xt, scale_inv=X.scale_inv), Wt,
                      out=torch.empty((24, 48), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias: must live with the operands"):
        grouped_fprop(Xt, Wt, np.zeros((3, 48), ml_dtypes.bfloat16),
                      out=torch.empty((24, 48), dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"out: dtype float32 differs from out_dtype='bfloat16'"):
        grouped_fprop(Xt, Wt, out=torch.empty((24, 48)))


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_flags_must_be_bools_even_after_a_memo_hit(request, backend):
    """fast_accum / accumulate: a bool (NumPy's too), not anything with a truth value. The call
    memo keys the options with their types, so fast_accum=1 does not reuse fast_accum=True's
    checked entry on the device path (which runs no second check)."""
    X, W, DY = make_fp8([5, 0, 19], 32, 48, seed=0)
    if backend == "cuda":                        # the device path, on torch tensors (fixture)
        request.getfixturevalue("torch_on_device")
        import torch

        X, W, DY = (_torch_operand(a) for a in (X, W, DY))
        new = {"fprop": lambda: torch.empty((24, 48), dtype=torch.bfloat16),
               "dgrad": lambda: torch.empty((24, 32), dtype=torch.bfloat16),
               "wgrad": lambda: torch.zeros((3, 48, 32))}
    else:
        new = {"fprop": lambda: None, "dgrad": lambda: None,
               "wgrad": lambda: np.zeros((3, 48, 32), np.float32)}
    calls = {"fprop": lambda **kw: grouped_fprop(X, W, out=new["fprop"](), **kw),
             "dgrad": lambda **kw: grouped_dgrad(DY, W, out=new["dgrad"](), **kw),
             "wgrad": lambda **kw: grouped_wgrad(X, DY, out=new["wgrad"](), **kw)}
    for name, call in calls.items():
        call(fast_accum=True)
        call(fast_accum=np.bool_(False))
        for bad in ("yes", 1, None):
            with pytest.raises(TypeError, match=rf"^fast_accum: expected a bool, got {bad!r}$"):
                call(fast_accum=bad)
    calls["wgrad"](accumulate=True)
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=rf"^accumulate: expected a bool, got {bad!r}$"):
            calls["wgrad"](accumulate=bad)
    gg.clear_memo()


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
def test_torch_tensors_in_torch_tensors_out(torch_on_device, pass_name):
    """Torch operands without out=: the output comes from torch (CUDA: torch's allocator, here
    the fixture's CPU stand-in) with the reference's values; with torch CPU tensors and the
    reference backend, the NumPy twin runs on zero-copy views and returns a torch tensor."""
    import torch

    fn, tens, odt, ref = _torch_case(pass_name)
    got = fn(*tens, out_dtype=odt)                       # "CUDA" path, new torch output
    assert isinstance(got, torch.Tensor) and got.dtype == getattr(torch, odt)
    _model_close(_torch_np(got), ref, odt)


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
def test_torch_cpu_tensors_run_the_reference_and_return_torch(pass_name):
    torch = pytest.importorskip("torch")
    fn, tens, odt, ref = _torch_case(pass_name)
    got = fn(*tens, out_dtype=odt)                       # the twin on views of the tensors
    assert isinstance(got, torch.Tensor) and got.dtype == getattr(torch, odt)
    assert np.array_equal(_torch_np(got).view(np.uint8), ref.view(np.uint8))
    out = torch.full(tuple(ref.shape), float("nan"), dtype=getattr(torch, odt))
    assert fn(*tens, out=out, out_dtype=odt) is out      # written in place through a view
    assert np.array_equal(_torch_np(out).view(np.uint8), ref.view(np.uint8))
    gg.clear_memo()


def _torch_case(pass_name):
    """(op, its operands as torch CPU tensors, out dtype, the reference's result)."""
    X, W, DY = make_fp8([5, 0, 19], 32, 48, seed=0)
    fn, host = _pass_call(pass_name, X, W, DY)
    odt = "float32" if pass_name == "wgrad" else "bfloat16"
    ref = np.asarray(fn(*host, out_dtype=odt, backend="reference"))
    return fn, tuple(_torch_operand(a) for a in host), odt, ref


def _torch_np(t):
    import torch

    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 \
        else t.numpy()


def test_memo_keys_torch_tensors(torch_on_device):
    """A torch key holds everything as_view reads: new tensor objects over the same memory hit
    (the torch layer builds its GroupedFP8 and views anew on every call); another pointer, shape,
    stride or dtype misses, and what a miss computes is what a fresh check gives."""
    import torch

    from cugrouped.ops import _gemm_memo

    X, W, DY = make_fp8([5, 0, 19], 32, 48, seed=4)
    kw = dict(out_dtype="bfloat16", fast_accum=True)
    Xt, Wt = _torch_operand(X), _torch_operand(W)
    c1 = gg.checked("fprop", (Xt, Wt, None), kw)
    assert gg._call_key("fprop", (Xt, Wt, None), kw) is not None
    again = gg.checked("fprop", (_torch_operand(X), _torch_operand(W), None), kw)
    assert again.problem is c1.problem and again.outs is c1.outs
    t = Xt.data
    assert _gemm_memo._array_key(t) == (torch.Tensor, t.data_ptr(), t.shape, t.stride(), t.dtype,
                                          t.device)
    # another pointer: a copy of the data, or of the scales
    for X2 in (dataclasses.replace(Xt, data=Xt.data.clone()),
               dataclasses.replace(Xt, scale_inv=Xt.scale_inv.clone())):
        c = gg.checked("fprop", (X2, Wt, None), kw)
        assert c.problem is not c1.problem and _same_problem(c.problem, gg.check_fprop(X2, Wt))
    # same pointer, another shape: the check runs again (and refuses)
    with pytest.raises(ValueError, match=r"x.data: expected a contiguous \(24, 32\)"):
        gg.checked("fprop", (dataclasses.replace(Xt, data=Xt.data.view(12, 64)), Wt, None), kw)
    # plain operands: same pointer and shape, another row stride or dtype
    rng = np.random.default_rng(0)
    buf = torch.from_numpy(rand(rng, (2, 24, 64)).astype(np.float16))
    xs = [buf[0, :, :32], buf[1, :, :32]]                       # rows 64 apart
    ws = torch.from_numpy(rand(rng, (2, 16, 32)).astype(np.float16))
    kw16 = dict(out_dtype="float32", fast_accum=False)
    c16 = gg.checked("fprop", (xs, ws, None), kw16)
    dense = [torch.as_strided(x, (24, 32), (32, 1)) for x in xs]   # rows 32 apart
    assert all(d.data_ptr() == x.data_ptr() for d, x in zip(dense, xs))
    c = gg.checked("fprop", (dense, ws, None), kw16)
    assert c.problem is not c16.problem
    assert gg.as_blocks(c16.problem.left).ld.tolist() == [64, 64]
    assert gg.as_blocks(c.problem.left).ld.tolist() == [32, 32]
    as_bf16 = [x.view(torch.bfloat16) for x in xs]
    with pytest.raises(TypeError, match=r"x: dtype bfloat16 differs from w's float16"):
        gg.checked("fprop", (as_bf16, ws, None), kw16)
    # outputs: keyed per tensor, a new view of the same memory hits, another buffer misses
    out = torch.empty((24, 48), dtype=torch.bfloat16)
    _, _, vp = gg.prepared_out(c1, out, None)
    assert gg.prepared_out(c1, out[:], None)[2] is vp
    _, b2, vp2 = gg.prepared_out(c1, torch.empty((24, 48), dtype=torch.bfloat16), None)
    assert vp2 is not vp
    with pytest.raises(ValueError, match=r"out: expected shape \(24, 48\)"):
        gg.prepared_out(c1, out.view(48, 24), None)
    # torch tensor subclasses are not keyed (they may compute what they report)

    class Sub(torch.Tensor):
        pass

    sub = dataclasses.replace(Xt, data=Xt.data.as_subclass(Sub))
    assert gg._call_key("fprop", (sub, Wt, None), kw) is None
    param = torch.nn.Parameter(Wt.data, requires_grad=False)        # torch's own subclass: keyed
    assert gg._call_key("fprop", (Xt, dataclasses.replace(Wt, data=param), None), kw) is not None


def test_memo_keeps_no_arrays_alive(torch_on_device):
    """The memo stores numbers only: the tensors of a memoised call are freed when the caller
    drops them (a memo holding activations would hold their GPU memory)."""
    import gc
    import weakref

    from cugrouped.ops import _gemm_memo

    X, W, _ = make_fp8([5, 0, 19], 32, 48, seed=4)
    Xt, Wt = _torch_operand(X), _torch_operand(W)
    out = _torch_cpu(np.empty((24, 48), ml_dtypes.bfloat16))
    refs = [weakref.ref(t) for t in (Xt.data, Xt.scale_inv, Wt.data, out)]
    grouped_fprop(Xt, Wt, out=out)
    assert len(_gemm_memo._memo) == 1
    del Xt, Wt, out
    gc.collect()
    assert [r() for r in refs] == [None] * 4


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "checked"])
@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad", "wgrad_accumulate"])
def test_custom_ops_cuda_branch_passes_tensors_as_they_are(torch_on_device, pass_name, direct,
                                                           monkeypatch):
    """The torch layer's GEMM custom ops with their CUDA branch (backend "cuda": tensors handed to
    the op as they are, no DLPack) on CPU tensors, against the same ops' CPU branch (NumPy views,
    reference backend): by their direct route (ops/_gemm_direct.py, no checks) and through the
    public ops' checks, computed by the cuBLASLt model from the calls the loop makes."""
    import torch

    from cugrouped.pytorch import _custom_ops as cops

    monkeypatch.setattr(cops, "DIRECT_GEMMS", direct)

    _, _, kinds, _ = torch_on_device
    m_splits, k, n = [5, 0, 19, 40], 32, 48
    X, W, DY = make_fp8(m_splits, k, n, seed=12)
    t = _torch_cpu
    xd, xs, xt = t(X.data), t(X.scale_inv), t(X.data_t)
    dyd, dys, dyt = t(DY.data), t(DY.scale_inv), t(DY.data_t)
    wd, ws, wt = t(W.data), t(W.scale_inv), t(W.data_t)
    E_ = len(m_splits)
    if pass_name == "fprop":
        bias = list(t(np.random.default_rng(1).standard_normal((E_, n)).astype(ml_dtypes.bfloat16)))
        want = cops.fp8_fprop(xd, xs, "e4m3", wd, ws, "e4m3", bias, m_splits, torch.bfloat16)
        got = torch.full_like(want, float("nan"))
        kinds.clear()
        cops._fprop_into(got, xd, xs, "e4m3", wd, ws, "e4m3", bias, m_splits, "cuda")
    elif pass_name == "dgrad":
        want = cops.fp8_dgrad(dyd, dys, "e5m2", wt, ws, "e4m3", k, m_splits, torch.bfloat16)
        got = torch.full_like(want, float("nan"))
        kinds.clear()
        cops._dgrad_into(got, dyd, dys, "e5m2", wt, ws, "e4m3", k, m_splits, "cuda")
    elif pass_name == "wgrad":
        want = cops.fp8_wgrad(xt, xs, "e4m3", dyt, dys, "e5m2", k, n, m_splits, torch.float32)
        got = torch.full_like(want, float("nan"))
        kinds.clear()
        cops._wgrad(xt, xs, "e4m3", dyt, dys, "e5m2", k, n, m_splits, got, False, "float32", "cuda")
    else:
        before = torch.randn(E_, n, k, generator=torch.Generator().manual_seed(0))
        want, got = before.clone(), before.clone()
        cops.fp8_wgrad_main_grad(xt, xs, "e4m3", dyt, dys, "e5m2", k, n, m_splits, list(want),
                                 True)
        kinds.clear()
        cops._wgrad(xt, xs, "e4m3", dyt, dys, "e5m2", k, n, m_splits, list(got), True, "float32",
                    "cuda")
        assert torch.equal(got[1], before[1])          # the empty expert is left untouched
    assert kinds == (set() if direct else {"torch"})      # the direct route views nothing
    odt = "float32" if got.dtype == torch.float32 else "bfloat16"
    _model_close(got.float().numpy(), want.float().numpy(), odt)


def test_gemm_workspaces_are_not_allocated_inside_a_graph_capture(monkeypatch):
    """A first GEMM call on a stream being captured into a CUDA graph would allocate its
    workspace from CuPy's pool (cudaMalloc invalidates the capture with a bare CUDA error): it
    raises a RuntimeError that says to warm up on the capturing stream instead."""
    import cupy

    from cugrouped.bench.gemm import host_loop_state

    st = host_loop_state()
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda ptr: ptr == 0x5000)
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: pytest.fail("allocated during capture"))
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        st.caller_workspace(0x5000)
    st.caller_ws[0x6000] = 0x7000                     # made before the capture: used as it is
    assert st.caller_workspace(0x6000) == 0x7000


@pytest.mark.gpu
def test_gpu_torch_tensors_in_torch_tensors_out_on_torchs_stream():
    """grouped_fprop on CUDA torch tensors, called on a torch side stream with no out=: a torch
    output from torch's allocator, computed on that stream, within the FP8 tolerance."""
    torch = pytest.importorskip("torch")
    m_splits, k, n = [40, 0, 24], 64, 32
    X, W, _ = make_fp8(m_splits, k, n, seed=3)
    ref = np.asarray(grouped_fprop(X, W, out_dtype="float32", backend="reference"))

    def cuda(op):
        t = _torch_operand(op)
        return dataclasses.replace(t, **{f: getattr(t, f).cuda() for f in
                                         ("data", "amax", "scale", "scale_inv")
                                         if getattr(t, f) is not None})

    Xc, Wc = cuda(X), cuda(W)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = grouped_fprop(Xc, Wc, out_dtype="float32")
    s.synchronize()
    assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == torch.float32
    xs, ws = independent(X, "rowwise"), independent(W, "rowwise")
    _assert_close(y.cpu().numpy(), ref, _abs_sum(xs, ws, "fprop"), "float32", FAST_ACC_EPS)


def test_one_array_and_m_splits_equal_the_list_form():
    """Like the cast op and GroupedLinear, the GEMMs take one (sum(m_i), ·) array plus host split
    sizes for plain operands: the same results as the list of row views (views, no copies)."""
    rng = np.random.default_rng(5)
    sp = [7, 0, 12, 3]
    x, dy = rand(rng, (22, 32)), rand(rng, (22, 48))
    ws = [rand(rng, (48, 32)) for _ in sp]
    xs, dys = np.split(x, np.cumsum(sp)[:-1]), np.split(dy, np.cumsum(sp)[:-1])
    for splits in (sp, np.array(sp), [np.int64(v) for v in sp]):
        np.testing.assert_array_equal(grouped_fprop(x, ws, m_splits=splits), grouped_fprop(xs, ws))
        np.testing.assert_array_equal(grouped_dgrad(dy, ws, m_splits=splits), grouped_dgrad(dys, ws))
        np.testing.assert_array_equal(grouped_wgrad(x, dy, m_splits=splits), grouped_wgrad(xs, dys))
    np.testing.assert_array_equal(cugrouped.reference.grouped_fprop(x, ws, m_splits=sp),
                                  grouped_fprop(xs, ws))


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, xs, ws: grouped_fprop(x, ws, m_splits=[7, 0, 12]), ValueError,
     r"m_splits: expected non-negative counts summing to x's 22 rows, got \[7, 0, 12\]"),
    (lambda x, xs, ws: grouped_fprop(x, ws, m_splits=[7, 0, 16, -1]), ValueError, "non-negative"),
    (lambda x, xs, ws: grouped_fprop(x, ws, m_splits=[7.0, 0, 12, 3]), TypeError,
     "m_splits: expected a 1-D sequence of non-negative ints"),
    (lambda x, xs, ws: grouped_fprop(xs, ws, m_splits=[7, 0, 12, 3]), ValueError,
     "m_splits: goes with one 2-D x array"),
    (lambda x, xs, ws: grouped_fprop(x[None], ws, m_splits=[7, 0, 12, 3]), TypeError,
     r"x: with m_splits, expected one 2-D \(sum\(m_splits\), cols\) array, got ndarray of shape"),
])
def test_m_splits_errors(call, exc, match):
    rng = np.random.default_rng(5)
    x = rand(rng, (22, 32))
    xs, ws = np.split(x, [7, 7, 19]), [rand(rng, (48, 32)) for _ in range(4)]
    with pytest.raises(exc, match=match):
        call(x, xs, ws)


@pytest.mark.parametrize("ptrs,want", [
    ([0x1000], (0x1000, 4, 1)), ([0x1000, 0x1004, 0x1008], (0x1000, 4, 3)),
    ([0x1000, 0x1010], (0x1000, 16, 2)), ([0x1000, 0x1004, 0x100C], None),
    ([0x1000, 0x1000], None), ([0x1008, 0x1004], None), ([0x1000, 0x1002], None),
    ([0x1000, 0x1000 + gg.SCALE_SPAN_MAX + 4], None)])
def test_scale_span_is_even_steps_through_one_array_only(ptrs, want):
    from cugrouped.ops._gemm_plan import scale_span

    assert scale_span(np.asarray(ptrs, np.int64)) == want


def test_scales_of_one_array_go_to_each_experts_own_slot_whatever_the_counts():
    """An (E,) scale_inv is copied whole, expert e's float to slot e: with other experts empty
    (new token counts) every expert's new scale pointer is the same, so no descriptor is re-set."""
    X, W, _ = make_fp8([5, 3, 19, 3], 32, 16, seed=1)
    X2 = cugrouped.multi_pad_cast_transpose(
        [np.ones((m, 32), np.float32) for m in (0, 6, 0, 2)])
    dst = 0x7C0000000000
    rows = {}
    for name, x in (("all", X), ("some empty", X2)):
        p = gg.check_fprop(x, W)
        vp = gg.plan_arrays(p, gg.outputs(p, None, np)[1])
        copies, launch_rows = vp.realigned(dst)
        assert [(c.src, c.spitch, c.height) for c in copies] == [
            (int(np.asarray(W.scale_inv).ctypes.data), 4, 4),
            (int(np.asarray(x.scale_inv).ctypes.data), 4, 4)]
        rows[name] = {r[0]: r[4:6] for r in launch_rows}
    assert rows["some empty"] == {e: rows["all"][e] for e in (1, 3)}
    assert rows["all"][2] == (dst + 32, dst + 4 * 16 + 32)


def test_scale_inv_at_a_stride_is_read_in_place():
    """A GroupedFP8 whose scale_inv is a strided (E,) view (each in its own 16-byte slot): the
    same results as with a packed copy, and the loop reads the scales where they are (no copy);
    a zero or negative stride is refused, naming the argument."""
    X, W, DY = make_fp8([5, 0, 19, 3], 32, 16, seed=2)
    slots = np.zeros((4, 4), np.float32)
    slots[:, 0] = X.scale_inv
    Xs = dataclasses.replace(X, scale_inv=slots[:, 0])
    want = grouped_fprop(X, W)
    np.testing.assert_array_equal(np.asarray(grouped_fprop(Xs, W)).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    p = gg.check_fprop(Xs, W)
    assert list(p.left_scale) == [slots.ctypes.data + 16 * e for e in range(4)]
    vp = gg.plan_arrays(p, gg.outputs(p, None, np)[1])
    assert [c for c in vp.realigned(0x7C0000000000)[0] if c.src == slots.ctypes.data] == []
    with pytest.raises(ValueError, match="x.scale_inv: expected a float32 array of shape"):
        gg.check_fprop(dataclasses.replace(X, scale_inv=np.asarray(X.scale_inv)[::-1]), W)
