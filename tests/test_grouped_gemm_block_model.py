"""Block-scaled grouped GEMMs run on the CPU by the NumPy model of ``cublasLtMatmul``
(test_grouped_gemm.py): Float8BlockScaling's operands (scale modes VEC128_32F and BLK128x128_32F)
and MXFP8's (VEC32_UE8M0), through the per-expert loop and through cuBLASLt's grouped GEMM, whose
per-group scale pointers the emulated setup kernel writes. The model reads the scale modes back
from the real descriptors and applies each block's scale from the layouts it counts itself, so a
wrong scale pointer, layout or mode fails here, not first on a GPU; the path rules of the grouped
block-scaled GEMM (TransformerEngine's: MXFP8 on sm_100+, 128-element blocks on Hopper with
cuBLAS 13.6+, never 2-D x 2-D)."""

from __future__ import annotations

import numpy as np
import pytest

import cugrouped
from cugrouped.cublaslt import _enums as E
from cugrouped.ops import grouped_gemm as gg
from cugrouped.ops.grouped_gemm import grouped_dgrad, grouped_fprop, grouped_wgrad
from test_grouped_gemm import NO_GROUPED_LIB, _model_close, _model_state, rand

KINDS = {   # name -> (compute capability, token multiple of the GEMM's reduction)
    "block": (90, 16),
    "mxfp8": (100, 32),
}
# name -> (m_splits, k, n): partial 128-blocks in k and n, an empty expert, token counts whole
# multiples of the recipe's padding (so the grouped path may take them)
SPLITS = {
    "block": {"jagged": ([32, 0, 144, 16], 272, 144), "uniform": ([128, 128], 256, 128)},
    "mxfp8": {"jagged": ([32, 0, 160, 64], 288, 160), "uniform": ([128, 128], 256, 128)},
}
PASSES = {"fprop": grouped_fprop, "dgrad": grouped_dgrad, "wgrad": grouped_wgrad}


def make_operands(kind, m_splits, k, n, seed, x_dims=1):
    rng = np.random.default_rng(seed)
    xs = [rand(rng, (m, k)) for m in m_splits]
    ws = [rand(rng, (n, k), 0.1) for _ in m_splits]
    dys = [rand(rng, (m, n)) for m in m_splits]
    if kind == "mxfp8":
        cast = cugrouped.multi_mxfp8_cast_transpose
        return cast(xs), cast(ws), cast(dys, fp8_format="e5m2")
    cast = cugrouped.multi_block_cast_transpose
    return (cast(xs, block_scaling_dim=x_dims), cast(ws, block_scaling_dim=2, align=1),
            cast(dys, block_scaling_dim=1, fp8_format="e5m2"))


def _args(pass_name, X, W, DY):
    return {"fprop": (X, W), "dgrad": (DY, W), "wgrad": (X, DY)}[pass_name]


def _state(kind, grouped):
    st, calls = _model_state(grouped=grouped)
    st.compute_capability = KINDS[kind][0]
    st.cublas_version = 131000
    return st, calls


def _run(kind, pass_name, args, path, out=None, accumulate=False):
    odt = "float32" if pass_name == "wgrad" else "bfloat16"
    kw = dict(out_dtype=odt, fast_accum=False)
    if pass_name == "wgrad":
        kw["accumulate"] = accumulate
    st, calls = _state(kind, path == "grouped")
    call = gg.checked(pass_name, args, kw)
    if out is None:
        out = gg.new_output(call.problem, np)
        out[...] = np.nan
    gg.launch_checked(call, out, np, st, path)
    return out, calls, odt


@pytest.mark.parametrize("path", ["loop", "grouped"])
@pytest.mark.parametrize("pass_name", list(PASSES))
@pytest.mark.parametrize("split", ["jagged", "uniform"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_calls_computed_by_the_model_equal_the_reference(kind, split, pass_name, path):
    gg.clear_memo()
    m_splits, k, n = SPLITS[kind][split]
    args = _args(pass_name, *make_operands(kind, m_splits, k, n, seed=31))
    out, calls, odt = _run(kind, pass_name, args, path)
    assert len(calls) == sum(1 for m in m_splits if m)
    assert all(c["grouped"] == (path == "grouped") for c in calls)
    _model_close(out, np.asarray(PASSES[pass_name](*args, out_dtype=odt, backend="reference")), odt)
    gg.clear_memo()


@pytest.mark.parametrize("x_dims", [1, 2])
def test_block_activations_of_either_block_kind_take_the_grouped_path(x_dims):
    """x with 128 x 128 blocks (TransformerEngine allows it): wgrad reads x's transposed 2-D
    scales against dy's 1-D ones (fprop would be 2-D x 2-D, refused by the operand checks)."""
    gg.clear_memo()
    m_splits, k, n = SPLITS["block"]["jagged"]
    X, W, DY = make_operands("block", m_splits, k, n, seed=32, x_dims=x_dims)
    for pass_name in ("fprop", "wgrad") if x_dims == 1 else ("wgrad",):
        args = _args(pass_name, X, W, DY)
        st, _ = _state("block", True)
        call = gg.checked(pass_name, args, dict(out_dtype="float32", fast_accum=False,
                                                **({"accumulate": False} if pass_name == "wgrad" else {})))
        out, blocks, vp = gg.prepared_out(call, None, np)
        path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
        assert path == "grouped", reason
        got, calls, odt = _run("block", pass_name, args, "grouped")
        assert calls and all(c["grouped"] for c in calls)
        _model_close(got, np.asarray(PASSES[pass_name](*args, out_dtype=odt, backend="reference")),
                     odt)
    gg.clear_memo()


@pytest.mark.parametrize("kind", list(KINDS))
def test_grouped_wgrad_accumulates_into_main_grad(kind):
    """beta = 1 with C = D = the stacked main_grad (evenly placed: one grouped call); the empty
    expert's buffer is left as it was."""
    gg.clear_memo()
    m_splits, k, n = SPLITS[kind]["jagged"]
    X, _, DY = make_operands(kind, m_splits, k, n, seed=33)
    rng = np.random.default_rng(34)
    before = np.stack([rand(rng, (n, k)) for _ in m_splits])
    got, want = before.copy(), [b.copy() for b in before]
    _, calls, _ = _run(kind, "wgrad", (X, DY), "grouped", out=list(got), accumulate=True)
    assert calls and all(c["grouped"] for c in calls)
    grouped_wgrad(X, DY, out=want, accumulate=True, backend="reference")
    for g_, w_ in zip(got, want):
        _model_close(g_, w_, "float32")
    assert np.array_equal(got[1], before[1])
    gg.clear_memo()


@pytest.mark.parametrize("pass_name", list(PASSES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_grouped_arrays_equal_the_loop_calls(kind, pass_name):
    """Exact: every group's operand, output and scale pointers and shapes, as the emulated setup
    kernel writes them, are those of the loop's call for that expert."""
    from test_grouped_gemm import _read_groups

    gg.clear_memo()
    m_splits, k, n = SPLITS[kind]["jagged"]
    args = _args(pass_name, *make_operands(kind, m_splits, k, n, seed=39))
    st, _ = _state(kind, True)
    st.matmul = lambda *a: 0
    call = gg.checked(pass_name, args, dict(out_dtype="float32", fast_accum=False, **(
        {"accumulate": False} if pass_name == "wgrad" else {})))
    out, blocks, vp = gg.prepared_out(call, None, np)
    path, reason, spec = gg.path_for(call.problem, vp, blocks, st)
    assert path == "grouped", reason
    gg._launch_plan(vp, call.problem, blocks, st)
    groups, _, _ = _read_groups(st.grouped.workspaces[0], spec.groups)
    loop = vp.calls()
    assert len(groups) == len(loop) == sum(1 for m in m_splits if m)
    for g, c in zip(groups, loop):
        assert (g["a"], g["b"], g["d"], g["sa"], g["sb"]) == (
            c.a_ptr, c.b_ptr, c.d_ptr, c.a_scale_ptr, c.b_scale_ptr)
        assert (g["a_rows"], g["a_cols"], g["a_ld"]) == c.a_layout[1:]
        assert (g["b_rows"], g["b_cols"], g["b_ld"]) == c.b_layout[1:]
    gg.clear_memo()


def test_scale_rule_fit():
    """_scale_spec: a rule reproducing each layout's pointers is found from them alone (leading
    empty experts included), per-tensor scales stay one float32 per expert, and pointers no rule reproduces
    give None (the loop)."""
    from cugrouped.ops._gemm_grouped import _SCALE_ROWS, _scale_spec

    tokens = np.array([0, 0, 48, 130, 16], np.int64)
    base = 0x7F0000000000
    for div, mult in _SCALE_ROWS:
        q = ((tokens + div - 1) // div + mult - 1) // mult * mult
        ptrs = base + 96 * np.concatenate([[0], np.cumsum(q)[:-1]])
        sc = _scale_spec(tuple(int(p) for p in ptrs), tokens, True)
        # (another rule may reproduce the same pointers for these tokens: equally right)
        assert sc is not None and sc.group_stride == 0
        got = sc.base + sc.token_stride * np.concatenate([[0], np.cumsum(sc.q(tokens))[:-1]])
        assert np.array_equal(got, ptrs), (div, mult)
    weights = tuple(base + 512 * e for e in range(5))
    assert _scale_spec(weights, tokens, True) == gg_setup().ScaleSpec(base, 512, 0)
    assert _scale_spec(tuple(base + 4 * e for e in range(5)), tokens, False) == \
        gg_setup().ScaleSpec.per_expert_float(base)
    assert _scale_spec(tuple(base + 8 * e for e in range(5)), tokens, False) is None
    gapped = (base, base, base + 64, base + 64 + 4 * 131, base + 4096)
    assert _scale_spec(gapped, tokens, True) is None
    assert _scale_spec(None, tokens, True) == gg_setup().ScaleSpec()


def gg_setup():
    from cugrouped.ops import grouped_gemm_setup

    return grouped_gemm_setup


def test_grouped_block_rules():
    VEC, BLK = E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
    MX = E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
    assert gg.grouped_block_unsupported(130600, 90, BLK, VEC) is None
    assert gg.grouped_block_unsupported(130600, 90, VEC, VEC) is None
    assert "13.6" in gg.grouped_block_unsupported(130500, 90, BLK, VEC)
    assert "Hopper" in gg.grouped_block_unsupported(131000, 100, BLK, VEC)
    assert gg.grouped_block_unsupported(130300, 100, MX, MX) is None
    assert gg.grouped_block_unsupported(130300, 110, MX, MX) is None
    assert "sm_100" in gg.grouped_block_unsupported(131000, 90, MX, MX)
    assert "13.3" in gg.grouped_block_unsupported(130200, 100, MX, MX)


@pytest.mark.parametrize("kind", list(KINDS))
def test_grouped_path_refusals_for_block_operands(kind):
    """Old cuBLAS or token counts that are not whole 16-byte multiples: the loop, with the reason;
    path='grouped' then raises."""
    gg.clear_memo()
    m_splits, k, n = SPLITS[kind]["jagged"]
    X, W, _ = make_operands(kind, m_splits, k, n, seed=35)
    st, _ = _state(kind, True)
    call = gg.checked("fprop", (X, W), dict(out_dtype="bfloat16", fast_accum=False))
    _, blocks, vp = gg.prepared_out(call, None, np)
    assert gg.path_for(call.problem, vp, blocks, st)[0] == "grouped"
    st.cublas_version = {"block": 130500, "mxfp8": 130200}[kind]
    path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
    assert path == "loop" and ("13.6" in reason or "13.3" in reason), reason
    with pytest.raises(RuntimeError, match="path='grouped' cannot run"):
        gg.path_for(call.problem, vp, blocks, st, "grouped")
    if kind == "mxfp8":       # MXFP8 token counts are multiples of 32 on every path
        return
    X8, W8, _ = make_operands(kind, [8, 40], k, n, seed=36)
    st.cublas_version = 131000
    call = gg.checked("fprop", (X8, W8), dict(out_dtype="bfloat16", fast_accum=False))
    _, blocks, vp = gg.prepared_out(call, None, np)
    path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
    assert path == "loop" and "multiple of 16" in reason
    gg.clear_memo()


@pytest.mark.parametrize("pass_name", list(PASSES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_grouped_descriptors_take_the_block_scale_modes(kind, pass_name):
    """The real libcublasLt accepts every attribute of a block-scaled grouped call: the block
    scale modes (not PER_BATCH_SCALAR_32F), device pointer mode, the scale pointer arrays."""
    from cugrouped import cublaslt

    if not cublaslt.has_grouped_gemm():
        pytest.skip(NO_GROUPED_LIB)
    import dataclasses

    gg.clear_memo()
    m_splits, k, n = SPLITS[kind]["jagged"]
    args = _args(pass_name, *make_operands(kind, m_splits, k, n, seed=37))
    call = gg.checked(pass_name, args, dict(out_dtype="float32", fast_accum=False, **(
        {"accumulate": False} if pass_name == "wgrad" else {})))
    _, blocks, vp = gg.prepared_out(call, None, np)
    cfg = dataclasses.replace(vp.config, grouped=True)
    base = 0x7F1234560000
    desc, *_ = gg.grouped_descriptors(cfg, 3, base, vp, 32 << 20)
    attrs = cfg.attributes()
    mx, vec, blk = (E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0,
                    E.CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                    E.CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F)
    want = {"mxfp8": (mx, mx), "block": {"fprop": (blk, vec), "dgrad": (blk, vec),
                                         "wgrad": (vec, vec)}[pass_name]}[kind]
    assert (attrs["A_SCALE_MODE"], attrs["B_SCALE_MODE"]) == want
    assert attrs["POINTER_MODE"] == E.CUBLASLT_POINTER_MODE_DEVICE
    for name, value in attrs.items():
        assert desc.get(name) == value, name
    off, _ = gg.grouped_workspace_layout(3)
    assert desc.get("A_SCALE_POINTER") == base + off["a_scale"]
    assert desc.get("B_SCALE_POINTER") == base + off["b_scale"]
    gg.clear_memo()


@pytest.mark.gpu
@pytest.mark.parametrize("pass_name", list(PASSES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_grouped_block_vs_loop_vs_reference(kind, pass_name):
    """Where this GPU and cuBLAS take block-scaled operands in the grouped GEMM (Hopper + 13.6,
    or sm_100+ + 13.3 for MXFP8), it must give the loop's and the reference's result within the
    block GEMMs' tolerance (2^-11 of max |ref|, plus two output roundings); elsewhere the test
    says why not."""
    import cupy

    from test_grouped_gemm import _to_np, half_ulp

    gg.clear_memo()
    m_splits, k, n = SPLITS[kind]["jagged"]
    rng = np.random.default_rng(38)
    host_in = ([rand(rng, (m, k)) for m in m_splits], [rand(rng, (n, k), 0.1) for _ in m_splits],
               [rand(rng, (m, n)) for m in m_splits])
    dev_in = [[cupy.asarray(a) for a in group] for group in host_in]

    def operands(xs, ws, dys):
        if kind == "mxfp8":
            cast = cugrouped.multi_mxfp8_cast_transpose
            return cast(xs), cast(ws), cast(dys, fp8_format="e5m2")
        cast = cugrouped.multi_block_cast_transpose
        return cast(xs), cast(ws, block_scaling_dim=2, align=1), cast(dys, fp8_format="e5m2")

    dev = _args(pass_name, *operands(*dev_in))
    host = _args(pass_name, *operands(*host_in))
    odt = "float32" if pass_name == "wgrad" else "bfloat16"
    kw = {"accumulate": False} if pass_name == "wgrad" else {}
    st = gg._state(cupy.cuda.Device().id)
    call = gg.checked(pass_name, dev, dict(out_dtype=odt, fast_accum=False, **kw))
    _, blocks, vp = gg.prepared_out(call, None, cupy)
    path, reason, _ = gg.path_for(call.problem, vp, blocks, st)
    if path != "grouped":
        pytest.skip(f"grouped block-scaled GEMM not available here: {reason}")
    fn = PASSES[pass_name]
    with cugrouped.record_launches() as log:
        g = fn(*dev, out_dtype=odt, path="grouped", **kw)
    assert "cublasLtMatmul[grouped]" in [e.kernel for e in log]
    lp = fn(*dev, out_dtype=odt, path="loop", **kw)
    r = np.asarray(fn(*host, out_dtype=odt, **kw)).astype(np.float64)
    tol = 2 * half_ulp(r, odt) + 2**-11 * np.abs(r).max()
    for got in (g, lp):
        assert np.all(np.abs(_to_np(got, odt).astype(np.float64) - r) <= tol)
    gg.clear_memo()
