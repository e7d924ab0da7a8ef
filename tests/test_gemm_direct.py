"""The torch layer's direct route to the per-tensor FP8 GEMMs (cugrouped.ops._gemm_direct): what
it builds from pointers and counts must be what the public ops' checks build from the same
buffers (the Problem, the output blocks, the plan), and a custom op must make the same cuBLASLt
calls either way: same pointers, layouts, algorithms, scale and bias pointers, scale copies and
zeroed outputs, in the same order."""

from __future__ import annotations

import ctypes
import pathlib
import re
import sys
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))

import layer_host  # noqa: E402
from test_grouped_gemm import SPLITS  # noqa: E402

from cugrouped import _array  # noqa: E402
from cugrouped.cublaslt import descriptors as _D  # noqa: E402
from cugrouped.ops import _gemm_direct, _gemm_plan  # noqa: E402
from cugrouped.ops import grouped_gemm as gg  # noqa: E402
from cugrouped.ops._gemm_checks import check_dgrad, check_fprop, check_wgrad, outputs  # noqa: E402
from cugrouped.pytorch import _custom_ops as cops  # noqa: E402

TORCH_OUT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ALIGN = cops.token_align(0)


def buffers(m_splits, k, n, out_dtype, scale_stride=4):
    """Aligned CPU buffers shaped as the layer's casts and allocations make them (the scales at
    ``scale_stride`` floats apart: 4, the casts' 16-byte slots, or 1, contiguous)."""
    E = len(m_splits)
    rows = sum(m_splits)
    pad = sum(cops.padded(m, ALIGN) for m in m_splits)
    u8, f32 = torch.uint8, torch.float32

    def scales():
        return layer_host.aligned_empty((E, scale_stride), f32)[:, 0]

    b = {
        "x": layer_host.aligned_empty((rows, k), u8), "x_t": layer_host.aligned_empty(k * pad, u8),
        "x_si": scales(), "w": layer_host.aligned_empty((E * n, k), u8),
        "w_t": layer_host.aligned_empty(E * n * k, u8), "w_si": scales(),
        "dy": layer_host.aligned_empty((rows, n), u8), "dy_t": layer_host.aligned_empty(n * pad, u8),
        "dy_si": scales(),
        "y": layer_host.aligned_empty((rows, n), TORCH_OUT[out_dtype]),
        "dx": layer_host.aligned_empty((rows, k), TORCH_OUT[out_dtype]),
        "dw": layer_host.aligned_empty((E, n, k), TORCH_OUT[out_dtype]),
        "main": [layer_host.aligned_empty((n, k), TORCH_OUT[out_dtype]) for _ in range(E)],
        "bias": [layer_host.aligned_empty(n, TORCH_OUT["bfloat16" if out_dtype == "float32"
                                                      else out_dtype]) for _ in range(E)],
    }
    for v in b.values():        # defined values (nothing reads them: only pointers matter)
        for t in (v if isinstance(v, list) else [v]):
            t.zero_()
    return b


def checked(pass_name, b, m_splits, k, n, out_dtype, fmts, fast_accum, bias=False, out="dw",
            accumulate=False):
    """The public ops' problem and output blocks for the custom op's operands."""
    E = len(m_splits)
    same = cops._same
    if pass_name == "fprop":
        xg = cops._grouped(b["x"], None, b["x_si"], m_splits, k, fmts[0], ALIGN, same)
        wg = cops._grouped(b["w"], None, b["w_si"], [n] * E, k, fmts[1], 1, same)
        p = check_fprop(xg, wg, b["bias"] if bias else None, out_dtype=out_dtype,
                        fast_accum=fast_accum)
        return p, outputs(p, b["y"], None)[1]
    if pass_name == "dgrad":
        dyg = cops._grouped(b["dy"], None, b["dy_si"], m_splits, n, fmts[0], ALIGN, same)
        wg = cops._grouped(None, b["w_t"], b["w_si"], [n] * E, k, fmts[1], 1, same)
        p = check_dgrad(dyg, wg, out_dtype=out_dtype, fast_accum=fast_accum)
        return p, outputs(p, b["dx"], None)[1]
    xg = cops._grouped(None, b["x_t"], b["x_si"], m_splits, k, fmts[0], ALIGN, same)
    dyg = cops._grouped(None, b["dy_t"], b["dy_si"], m_splits, n, fmts[1], ALIGN, same)
    p = check_wgrad(xg, dyg, out_dtype=out_dtype, fast_accum=fast_accum, accumulate=accumulate)
    return p, outputs(p, b[out], None)[1]


def direct(pass_name, b, m_splits, k, n, out_dtype, fmts, fast_accum, bias=False, out="dw",
           accumulate=False):
    p = {name: (t.data_ptr() if isinstance(t, torch.Tensor) else None) for name, t in b.items()}
    p.update({name: cops._scales(b[name]) for name in ("x_si", "w_si", "dy_si")})
    if pass_name == "fprop":
        return _gemm_direct.fprop(p["x"], p["x_si"], fmts[0], p["w"], p["w_si"], fmts[1],
                                  m_splits, k, n, p["y"], out_dtype,
                                  tuple(t.data_ptr() for t in b["bias"]) if bias else None,
                                  fast_accum, 0)
    if pass_name == "dgrad":
        return _gemm_direct.dgrad(p["dy"], p["dy_si"], fmts[0], p["w_t"], p["w_si"], fmts[1],
                                  m_splits, k, n, p["dx"], out_dtype, fast_accum, 0)
    dst = tuple(t.data_ptr() for t in b["main"]) if out == "main" else p["dw"]
    return _gemm_direct.wgrad(p["x_t"], p["x_si"], fmts[0], p["dy_t"], p["dy_si"], fmts[1],
                              m_splits, k, n, ALIGN, dst, out_dtype, accumulate, fast_accum, 0)


def _values(v):
    if isinstance(v, _gemm_plan.Blocks):
        return tuple(v)
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.kind, tuple(v.tolist()))
    if isinstance(v, tuple) and v and all(type(x) is int or isinstance(x, np.integer) for x in v):
        return ("array", "i", tuple(int(x) for x in v))     # a tuple of ints reads as an array
    return v


def assert_same_problem(a, b):
    for f in _gemm_plan.Problem.__dataclass_fields__:
        va, vb = _values(getattr(a, f)), _values(getattr(b, f))
        assert va == vb, f"Problem.{f}: {va} != {vb}"


CASES = [("fprop", ("e4m3", "e4m3"), {}), ("fprop", ("e4m3", "e4m3"), {"bias": True}),
         ("dgrad", ("e5m2", "e4m3"), {}), ("wgrad", ("e4m3", "e5m2"), {}),
         ("wgrad", ("e4m3", "e5m2"), {"out": "main", "accumulate": True}),
         ("wgrad", ("e4m3", "e5m2"), {"out": "main"})]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("out_dtype,scale_stride", [("bfloat16", 4), ("float16", 1),
                                                    ("float32", 4), ("bfloat16", 1)])
@pytest.mark.parametrize("pass_name,fmts,kw", CASES)
def test_direct_problem_is_what_the_checks_build(split, out_dtype, scale_stride, pass_name, fmts,
                                                 kw):
    m_splits, k, n = SPLITS[split]
    b = buffers(m_splits, k, n, out_dtype, scale_stride)
    fast = pass_name == "fprop"
    with mock.patch.dict(_array._TORCH_DEVICES, {torch.device("cpu"): 0}):   # as CUDA tensors
        want, want_out = checked(pass_name, b, m_splits, k, n, out_dtype, fmts, fast, **kw)
    got, got_out = direct(pass_name, b, m_splits, k, n, out_dtype, fmts, fast, **kw)
    assert_same_problem(got, want)
    assert tuple(got_out) == tuple(want_out)
    a, c = _gemm_plan.plan_arrays(got, got_out), _gemm_plan.plan_arrays(want, want_out)
    assert (a.config, a.beta, a.zero, a.skipped) == (c.config, c.beta, c.zero, c.skipped)
    for f in ("keys", "ptrs", "mnk"):
        np.testing.assert_array_equal(getattr(a, f), getattr(c, f))


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("pass_name,fmts,kw", CASES)
def test_the_direct_blocks_hints_give_the_grouped_setup_the_same_arrays(split, pass_name, fmts,
                                                                        kw):
    """The builders' layout hints (``Blocks.affine``, ``consts``) spare the grouped GEMM's setup
    spec its array searches: with or without them, the setup writes the same per-group arrays
    (pointers, shapes, scale pointers) for the same counts; and the hints are never compared."""
    from cugrouped.ops import _gemm_grouped
    from cugrouped.reference.grouped_gemm_setup import setup_arrays

    m_splits, k, n = SPLITS[split]
    b = buffers(m_splits, k, n, "bfloat16", 1)
    problem, out = direct(pass_name, b, m_splits, k, n, "bfloat16", fmts, pass_name == "fprop",
                          **kw)
    bare = _gemm_plan.Problem(**{**problem.__dict__, "left": problem.left.replace(),
                                 "right": problem.right.replace()})
    bare_out = out.replace()
    assert bare_out.affine is None and bare_out == out
    vp = _gemm_plan.plan_arrays(problem, out)
    hinted = _gemm_grouped.grouped_setup_spec(problem, vp, out)
    searched = _gemm_grouped.grouped_setup_spec(bare, vp, bare_out)
    assert (hinted is None) == (searched is None)
    if searched is None:       # per-expert main_grad buffers, or a bias: not evenly placed
        return
    tokens = _gemm_grouped.grouped_tokens(problem)
    got, want = setup_arrays(hinted, tokens), setup_arrays(searched, tokens)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _value(arg):
    if isinstance(arg, ctypes.c_void_p):
        return arg.value
    obj = getattr(arg, "_obj", None)        # a byref(): what it points to
    if obj is not None:
        return bytes(obj)
    return arg


def _descs():
    return {d.handle.value: d for lst in _D._caches.expert_descs.values() for d in lst}


@pytest.fixture
def recorded():
    """Inside the layer_host harness (device calls faked): a function running ``fn`` that
    returns every device call of the GEMM loop it made, in order."""
    with layer_host.cuda_path_on_cpu():
        st = gg._state(0)

        def run(fn):
            calls = []
            st.matmul = lambda handle, desc, *a: calls.append(
                ("matmul", desc.value, tuple(_descs()[desc.value].ptrs),
                 *(_value(x) for x in a))) or 0
            st.memcpy2d = lambda *a: calls.append(("memcpy2d",) + a)
            st.memset = lambda *a: calls.append(("memset",) + a)
            fn()
            return calls
        yield run


@pytest.mark.parametrize("scale_stride", [4, 1])
@pytest.mark.parametrize("split", ["skewed", "empty_middle", "single", "not_mult16"])
@pytest.mark.parametrize("pass_name,fmts,kw", CASES)
def test_a_custom_op_makes_the_same_calls_either_way(recorded, split, pass_name, fmts, kw,
                                                     scale_stride):
    m_splits, k, n = SPLITS[split]
    b = buffers(m_splits, k, n, "bfloat16", scale_stride)
    fast = pass_name == "fprop"

    def op():
        if pass_name == "fprop":
            cops._fprop_into(b["y"], b["x"], b["x_si"], fmts[0], b["w"], b["w_si"], fmts[1],
                             b["bias"] if kw.get("bias") else [], m_splits, "cuda", fast)
        elif pass_name == "dgrad":
            cops._dgrad_into(b["dx"], b["dy"], b["dy_si"], fmts[0], b["w_t"], b["w_si"], fmts[1],
                             k, m_splits, "cuda", fast)
        else:
            out = b["main"] if kw.get("out") == "main" else b["dw"]
            cops._wgrad(b["x_t"], b["x_si"], fmts[0], b["dy_t"], b["dy_si"], fmts[1], k, n,
                        m_splits, out, kw.get("accumulate", False), "bfloat16", "cuda", fast)

    routed = []
    real_run = _gemm_direct.run
    with mock.patch.object(_gemm_direct, "run", lambda *a, **k: routed.append(a[0]) or
                           real_run(*a, **k)):
        direct_calls = recorded(op)
    assert routed == [pass_name]                 # the direct route was taken
    with mock.patch.object(cops, "DIRECT_GEMMS", False):
        checked_calls = recorded(op)
    live = sum(1 for m in m_splits if m)
    assert sum(c[0] == "matmul" for c in direct_calls) == live
    # scales in 16-byte slots are read where they are; packed ones are copied to slots first
    copies = [c for c in direct_calls if c[0] == "memcpy2d"]
    assert (copies == []) == (scale_stride == 4 or len(m_splits) == 1)
    assert direct_calls == checked_calls


def test_non_contiguous_main_grads_take_the_checked_path(recorded):
    """A main_grad with a row stride wider than k: the checks read its strides (the direct
    route describes contiguous outputs only)."""
    m_splits, k, n = SPLITS["uniform"]
    b = buffers(m_splits, k, n, "float32")
    wide = [layer_host.aligned_empty((n, 2 * k), torch.float32)[:, :k] for _ in m_splits]
    with mock.patch.object(_gemm_direct, "wgrad", side_effect=AssertionError("direct")):
        calls = recorded(lambda: cops._wgrad(b["x_t"], b["x_si"], "e4m3", b["dy_t"], b["dy_si"],
                                             "e5m2", k, n, m_splits, wide, True, "float32",
                                             "cuda"))
    assert sum(c[0] == "matmul" for c in calls) == len(m_splits)


def test_the_direct_route_plans_once_per_counts_and_buffers(recorded):
    """The same call again (same counts, same buffers) reuses its plan and makes the same calls;
    new counts, or a buffer elsewhere, plan anew; clear_memo forgets."""
    m_splits, k, n = SPLITS["skewed"]
    b = buffers(m_splits, k, n, "bfloat16")
    other = buffers(m_splits, k, n, "bfloat16")

    def fprop(splits, y):
        cops._fprop_into(y, b["x"], b["x_si"], "e4m3", b["w"], b["w_si"], "e4m3", [], splits,
                         "cuda", True)

    gg.clear_memo()
    planned = []
    real = _gemm_direct.fprop
    with mock.patch.dict(_gemm_direct._BUILDERS,
                         {"fprop": lambda *a: planned.append(a) or real(*a)}):
        first = recorded(lambda: fprop(m_splits, b["y"]))
        again = recorded(lambda: fprop(list(m_splits), b["y"]))
        assert len(planned) == 1 and again == first
        recorded(lambda: fprop([4, 129, 1, 70], b["y"]))      # new counts, the same rows
        recorded(lambda: fprop(m_splits, other["y"]))         # another output buffer
        assert len(planned) == 3
        gg.clear_memo()
        assert recorded(lambda: fprop(m_splits, b["y"])) == first and len(planned) == 4


def _bad_calls(b, m_splits, k, n):
    """Calls of the custom ops' CUDA branch with something the public checks refuse, each with
    the start of the error they raise."""
    E = len(m_splits)
    ok = dict(y=b["y"], x=b["x"], x_si=b["x_si"], w=b["w"], w_si=b["w_si"])

    def fprop(**kw):
        a = {**ok, **kw}
        return lambda: cops._fprop_into(a["y"], a["x"], a["x_si"], kw.get("xf", "e4m3"), a["w"],
                                        a["w_si"], kw.get("wf", "e4m3"), kw.get("bias", []),
                                        kw.get("splits", m_splits), "cuda", True)

    def wgrad(out, accumulate=True):
        return lambda: cops._wgrad(b["x_t"], b["x_si"], "e4m3", b["dy_t"], b["dy_si"], "e5m2", k,
                                   n, m_splits, out, accumulate, str(out[0].dtype)[6:], "cuda")

    main = b["main"]
    return {
        "counts over x's rows": (fprop(splits=[m + 1 for m in m_splits]), "x.data: expected"),
        "scales too few": (fprop(x_si=b["x_si"][:E - 1]), "x.scale_inv: expected"),
        "e5m2 x e5m2": (fprop(xf="e5m2", wf="e5m2"), "w, x: E5M2 x E5M2 is not"),
        "bias of another dtype": (fprop(bias=[t.float() for t in b["bias"]]), "bias[0]: expected"),
        "bias too few": (fprop(bias=b["bias"][:-1]), "bias: expected"),
        "main_grad too small": (wgrad([g[:, : k // 2] for g in main]), "out[0]: expected shape"),
        "main_grads too few": (wgrad(main[:-1]), "out: expected"),
        "main_grads of two dtypes": (wgrad([main[0]] + [g.to(torch.bfloat16) for g in main[1:]]),
                                     "out[1]: dtype"),
        "main_grad on another device": (wgrad([main[0].to("meta")] + main[1:]),
                                        "out[0]: tensors on meta are not supported"),
    }


@pytest.mark.parametrize("case", list(_bad_calls(buffers([3, 9], 32, 16, "float32"), [3, 9], 32,
                                                  16)))
def test_what_the_checks_refuse_goes_through_the_checks(recorded, case):
    """The custom ops are reachable as torch.ops.cugrouped.*: an argument the direct route does
    not expect (wrong sizes, counts, dtypes, formats, devices) is not described from its pointers
    but goes the public way, whose checks raise naming it; nothing is launched."""
    m_splits, k, n = [3, 9], 32, 16
    b = buffers(m_splits, k, n, "float32")
    call, match = _bad_calls(b, m_splits, k, n)[case]
    calls = []
    with mock.patch.object(_gemm_direct, "run", side_effect=AssertionError("direct route")), \
            pytest.raises((ValueError, TypeError, RuntimeError, NotImplementedError),
                          match=re.escape(match)) as err:
        calls = recorded(call)
    assert calls == [] and str(err.value).startswith(match)
