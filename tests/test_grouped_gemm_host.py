"""The grouped GEMMs' host-side shortcuts against the general code they stand in for: each fast
path (a cheap screen, a vectorized or scalar form) must give exactly what the general path gives,
on many random inputs, zero-token experts, first/last empty experts, E=1 and E=257 included."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped.cublaslt import _enums as E
from cugrouped.ops import _gemm_checks as C
from cugrouped.ops import grouped_gemm as gg
from cugrouped.ops._gemm_plan import shape_signature

FP8 = ("float8_e4m3fn", "float8_e5m2")
EXPERT_COUNTS = (1, 2, 3, 8, 64, 257)


def _random_blocks(rng, num: int, dtype: str, misalign: float) -> gg.Blocks:
    """Blocks at 256-aligned addresses and 16-multiple strides, a fraction ``misalign`` of
    pointers and strides knocked off by 1..15, with zero-, one- and many-row experts."""
    ptr = rng.integers(1, 1 << 30, num) * 256
    ld = rng.integers(1, 64, num) * 16
    rows = rng.choice([0, 1, 2, 17, 64], num)
    cols = rng.choice([0, 1, 16, 48], num)
    ptr = np.where(rng.random(num) < misalign, ptr + rng.integers(1, 16, num), ptr)
    ld = np.where(rng.random(num) < misalign, ld + rng.integers(1, 16, num), ld)
    return gg.Blocks(ptr, rows, cols, ld, dtype)


def _random_problem(rng, num: int, misalign: float) -> tuple[gg.Problem, gg.Blocks]:
    fp8 = bool(rng.random() < 0.7)
    in_dtype = str(rng.choice(FP8 if fp8 else ("bfloat16", "float16", "float32")))
    out_dtype = str(rng.choice(("bfloat16", "float16", "float32")))
    left, right, out = (_random_blocks(rng, num, d, misalign)
                        for d in (in_dtype, in_dtype, out_dtype))
    modes = (0, 0)
    scales = (None, None)
    if fp8:
        scales = tuple(np.where(rng.random(num) < misalign, s + rng.integers(1, 16, num), s)
                       for s in (rng.integers(1, 1 << 30, num) * 16 for _ in range(2)))
        if rng.random() < 0.5:
            modes = (E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                     E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F)
    p = gg.Problem("fprop", fp8, left, False, right, True, (16,) * num, scales[0], scales[1],
                   None, None, False, False, out_dtype, (True, 0, "cupy"), *modes)
    return p, out


@pytest.mark.parametrize("num", EXPERT_COUNTS)
def test_alignment_screen_passes_only_what_the_scan_passes(num):
    """``_surely_aligned`` (OR-reductions) never lets through what the per-expert scan refuses,
    and lets through most well-aligned calls (it is what makes the check cheap)."""
    rng = np.random.default_rng(num)
    passed = 0
    for trial in range(300):
        misalign = (0.0, 0.002, 0.05, 0.5)[trial % 4]
        p, out = _random_problem(rng, num, misalign)
        operands = (gg.as_blocks(p.left), gg.as_blocks(p.right), out)
        error = C._alignment_error(p, operands)
        if C._surely_aligned(p, operands):
            passed += 1
            assert error is None
        if error is None:
            gg.check_alignment(p, out)
        else:
            with pytest.raises(ValueError) as info:
                gg.check_alignment(p, out)
            assert str(info.value) == error
    assert passed >= 75          # every trial without misalignment passes the screen


def _wgrad_out_per_expert(out, num, n, k, out_dtype, place):
    """The dW output checked the general way: every expert's own view, one Block each."""
    import dataclasses

    if isinstance(out, list):
        if len(out) != num:
            raise ValueError(f"out: expected {num} per-expert arrays, got {len(out)}")
        views = [C._tagged_view(a, out_dtype, f"out[{i}]") for i, a in enumerate(out)]
        names = [f"out[{i}]" for i in range(num)]
    else:
        v = C._tagged_view(out, out_dtype, "out")
        if v.shape != (num, n, k):
            raise ValueError(f"out: expected shape ({num}, {n}, {k}) or a list of {num} "
                             f"({n}, {k}) arrays, got {v.shape}")
        views = [dataclasses.replace(v, ptr=v.ptr + e * v.strides[0] * v.itemsize,
                                     shape=v.shape[1:], strides=v.strides[1:])
                 for e in range(num)]
        names = ["out"] * num
    blocks = []
    for ev, name in zip(views, names):
        C._check_grad_view(ev, name, n, k, out_dtype, place)
        blocks.append(gg.Block(ev.ptr, n, k, ev.strides[0] if n > 1 else k, out_dtype))
    return gg.as_blocks(blocks)


def _outcome(f):
    try:
        return f()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("num", EXPERT_COUNTS)
def test_wgrad_outputs_give_what_checking_every_expert_view_gives(num):
    """A stacked dW output is checked once and its pointers stepped by its leading stride, a
    list's views checked and their blocks made in one go: the same blocks, or the same error,
    as checking each expert's view and making its Block."""
    place = (False, -1, "numpy")
    for n, k in ((16, 32), (1, 16), (16, 1), (1, 1)):
        base = np.zeros((2 * num, n + 1, 2 * k), np.float32)
        cases = [base[:num, :n, :k], base[::2, :n, :k], base[:num, :n, ::2][:, :, :k],
                 base[:num, :n, :k].astype(np.float16), base[:num, :n, :k].transpose(0, 2, 1),
                 base[:num, :n, :k + 1], np.zeros((num, n, k), np.float32)]
        lists = [list(c) for c in cases[:3]]
        for bad in (np.zeros((n, k), np.float16), np.zeros((n, k + 1), np.float32),
                    np.zeros((k, n), np.float32).T, np.zeros((n, k), np.float32)):
            lists.append(list(cases[0][:-1]) + [bad])
        cases += lists + [list(cases[0][:-1])]
        for out in cases:
            for out_dtype in ("float32", "float16"):
                want = _outcome(lambda: _wgrad_out_per_expert(out, num, n, k, out_dtype, place))
                got = _outcome(lambda: C._wgrad_out(out, num, n, k, out_dtype, place, np,
                                                    False)[1])
                assert type(got) is type(want) and got == want
                if isinstance(got, gg.Blocks):
                    assert got.dtype == want.dtype
        wrong_place = (True, 0, "cupy")
        want = _outcome(lambda: _wgrad_out_per_expert(cases[0], num, n, k, "float32", wrong_place))
        assert _outcome(lambda: C._wgrad_out(cases[0], num, n, k, "float32", wrong_place, np,
                                             False)) == want


def _random_splits(rng, num: int) -> list[int]:
    """Token counts with zeros, an empty first or last expert now and then."""
    m = [int(v) for v in rng.integers(0, 40, num)]
    m = [0 if rng.random() < 0.2 else v for v in m]
    if num > 1 and rng.random() < 0.5:
        m[0 if rng.random() < 0.5 else -1] = 0
    return m


@pytest.mark.parametrize("num", EXPERT_COUNTS)
def test_fp8_operand_blocks_and_scales_are_the_per_expert_addresses(num):
    """The vectorized FP8 operand: each expert's rows start at data + (tokens before it) * k
    (row-wise copy) or at data_t + k * (padded tokens before it) (transposed copy), and its
    scale pointer is scale_inv's address + 4 * expert."""
    from cugrouped.ops.pad_cast_transpose import multi_pad_cast_transpose

    rng = np.random.default_rng(200 + num)
    k = 32
    for _ in range(3):
        m = _random_splits(rng, num)
        g = multi_pad_cast_transpose([np.ones((v, k), np.float32) for v in m])
        scale = g.scale_inv.ctypes.data
        for copy in ("rowwise", "columnwise"):
            op = C._fp8_operand(g, copy, "x", "test")
            assert op.scale_inv.tolist() == [scale + 4 * e for e in range(num)]
            assert op.m_splits == tuple(m)
            want = []
            if copy == "rowwise":
                start = g.data.ctypes.data
                for v in m:
                    want.append(gg.Block(start, v, k, k, "float8_e4m3fn"))
                    start += v * k
            else:
                start = g.data_t.ctypes.data
                for v in g.m_pad_splits:
                    want.append(gg.Block(start, k, v, v, "float8_e4m3fn"))
                    start += v * k
            assert tuple(op.blocks) == tuple(want)


def _random_plan_problem(rng, num: int):
    """A problem of any pass layout (left/right stored transposed or not) with random sizes
    (zeros included), pointers of random alignment, scales, bias and accumulation."""
    lt, rt, fp8, accumulate = (bool(v) for v in rng.integers(0, 2, 4))
    dt, out_dt = ("float8_e4m3fn", "bfloat16") if fp8 else ("float16", "float32")

    def ptrs():
        return rng.integers(1, 1 << 36, num) << rng.integers(0, 10, num)

    p = _random_splits(rng, num)
    q = [int(rng.choice([0, 16, 48]))] * num if rng.random() < 0.8 else _random_splits(rng, num)
    r = [int(rng.choice([0, 16, 32]))] * num if rng.random() < 0.5 else _random_splits(rng, num)
    ldl, ldr, ldo = (rng.integers(1, 100, num) for _ in range(3))
    left = gg.Blocks(ptrs(), *((r, p) if lt else (p, r)), ldl, dt)
    right = gg.Blocks(ptrs(), *((q, r) if rt else (r, q)), ldr, dt)
    out = gg.Blocks(ptrs(), p, q, ldo, out_dt)
    scales = (ptrs(), ptrs()) if fp8 else (None, None)
    bias = ptrs() if rng.random() < 0.3 else None
    problem = gg.Problem("wgrad" if lt else "fprop", fp8, left, lt, right, rt, tuple(r), *scales,
                         bias, out_dt if bias is not None else None, fp8, accumulate, out_dt)
    return problem, out


def _plan_per_expert(problem, out):
    """plan_problem's answer made the general way: one plan_expert per non-empty expert."""
    calls, zero, skipped = [], [], []
    for i, (left, right, o, r) in enumerate(zip(problem.left, problem.right, out,
                                                problem.reduction)):
        if o.rows == 0 or o.cols == 0 or r == 0:
            skipped.append(i)
            if r == 0 and o.rows * o.cols and not problem.accumulate:
                zero.append(i)
            continue
        pick = lambda ptrs: 0 if ptrs is None else int(ptrs[i])  # noqa: E731
        calls.append(gg.plan_expert(
            i, left, problem.left_t, right, problem.right_t, o, r,
            beta=1.0 if problem.accumulate else 0.0, a_scale_ptr=pick(problem.right_scale),
            b_scale_ptr=pick(problem.left_scale), bias_ptr=pick(problem.bias)))
    return tuple(calls), tuple(zero), tuple(skipped)


@pytest.mark.parametrize("num", EXPERT_COUNTS)
def test_vectorized_plan_equals_plan_expert_on_random_problems(num):
    """plan_arrays (one table, alignments computed in place) against plan_expert per expert:
    the same calls, keys (alignments, the bias pointer's last), sizes, launch rows, zeroed and
    skipped experts, or the same error for a block of the wrong shape."""
    rng = np.random.default_rng(300 + num)
    for trial in range(40):
        problem, out = _random_plan_problem(rng, num)
        if trial % 5 == 4:      # one expert's left block of the wrong shape
            e = int(rng.integers(num))
            L = problem.left
            problem = gg.Problem(**{**problem.__dict__, "left": L.replace(
                rows=np.where(np.arange(num) == e, L.rows + 1, L.rows))})
        want = _outcome(lambda: _plan_per_expert(problem, out))
        got = _outcome(lambda: gg.plan_arrays(problem, out))
        if not isinstance(got, gg.VecPlan):
            assert got == want
            continue
        calls, zero, skipped = want
        vp = got
        assert (vp.calls(), vp.zero, vp.skipped) == want
        assert vp.keys[:, 12:16].tolist() == [list(c.alignments) for c in calls]
        assert vp.keys[:, 16].tolist() == [0 if problem.bias is None else
                                           gg.pointer_alignment(c.bias_ptr) for c in calls]
        assert vp.mnk.tolist() == [[c.m, c.n, c.k] for c in calls]
        assert [row[:7] for row in vp.launch_rows] == [
            (c.expert, c.a_ptr, c.b_ptr, c.d_ptr, c.a_scale_ptr, c.b_scale_ptr, c.bias_ptr)
            for c in calls]
        assert [shape_signature(row[7]) for row in vp.launch_rows] == [
            (*c.a_layout, *c.b_layout, *c.d_layout, *c.alignments,
             0 if problem.bias is None else gg.pointer_alignment(c.bias_ptr)) for c in calls]
        # one key per distinct signature: equal rows give equal keys, different ones differ
        keys = vp.keys.tolist()
        assert len({row[7] for row in vp.launch_rows}) == len({tuple(k) for k in keys})
        assert vp.config == gg.gemm_config(problem, vp.config.transa, vp.config.transb)


def test_in_place_pointer_alignments_are_the_scalar_rule():
    from cugrouped.ops._gemm_plan import _pointer_alignments_in_place

    rng = np.random.default_rng(7)
    ptrs = np.concatenate([[0, 1, 256, 512, 0x7F0000001010],
                           rng.integers(0, 1 << 40, 500) << rng.integers(0, 12, 500)])
    for cap in (256, 32, 1):
        a = ptrs.reshape(-1, 5).copy()
        _pointer_alignments_in_place(a, cap)
        assert a.reshape(-1).tolist() == [gg.pointer_alignment(int(v), cap) for v in ptrs]


def test_first_reads_the_first_block_without_making_it():
    from cugrouped.ops._gemm_plan import first

    rng = np.random.default_rng(9)
    for num in EXPERT_COUNTS:
        b = _random_blocks(rng, num, "bfloat16", 0.5)
        for field in ("ptr", "rows", "cols", "ld"):
            assert first(b, field) == getattr(b[0], field) == first(tuple(b), field)
            assert type(first(b, field)) is int
    for empty in (gg.as_blocks(()), ()):
        with pytest.raises(IndexError):
            first(empty, "rows")
