"""cugrouped.pytorch.GroupedLinear on CPU (casts on the CPU emulator unless a test says otherwise,
GEMMs on the NumPy reference), and the same checks on a GPU (marked ``gpu``)."""

from __future__ import annotations

import contextlib
import copy
import io
import gc
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from cugrouped import reference
from cugrouped.ops import record_launches
from cugrouped.pytorch import (DelayedScaling, Float8CurrentScaling, Format, GroupedLinear,
                               cpu_cast_backend, fp8_autocast, get_fp8_recipe)

SPLITS = {"uneven": [5, 17, 40], "empty_first": [0, 9, 23], "empty_middle": [12, 0, 7],
          "empty_last": [30, 1, 0], "single": [33]}
RECIPES = {"none": None, "delayed": DelayedScaling(amax_history_len=8),
           "current": Float8CurrentScaling(), "delayed_e4m3": DelayedScaling(
               fp8_format=Format.E4M3, amax_history_len=1, amax_compute_algo="most_recent")}


def _autocast(recipe):
    return fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe)


def make_layer(E, k=32, n=48, dtype=torch.float32, bias=True, seed=0, **kw):
    torch.manual_seed(seed)
    layer = GroupedLinear(E, k, n, bias=bias, params_dtype=dtype, device="cpu", **kw)
    with torch.no_grad():
        for b in layer.biases():
            b.normal_()
    return layer


def run(layer, xs, splits, recipe, list_mode, dy=None, steps=1, list_views=False, **fw):
    """forward + backward ``steps`` times; returns (output, input grads, weight grads, bias grads).
    ``list_views``: the list's tensors are views of one tensor (as a split gives them), so every
    expert's rows sit at the addresses the tensor form gives them."""
    for _ in range(steps):
        if list_mode and list_views:
            base = xs.detach().clone().requires_grad_()
            inp = list(base.split(splits))
        elif list_mode:
            inp = [x.detach().clone().requires_grad_() for x in xs.split(splits)]
        else:
            inp = xs.detach().clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        with _autocast(recipe):
            y = layer(inp, None if list_mode else splits, **fw)
        yc = torch.cat(y) if list_mode else y
        yc.backward(dy if dy is not None else torch.ones_like(yc))
    dx = base.grad if list_mode and list_views else \
        torch.cat([x.grad for x in inp]) if list_mode else inp.grad
    return (yc.detach(), dx, [w.grad for w in layer.weights()],
            [b.grad for b in layer.biases()])


def assert_bits_equal(a, b, label=""):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), label
        for i, (u, v) in enumerate(zip(a, b)):
            assert_bits_equal(u, v, f"{label}[{i}]")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, label
    assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b), label


# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("splits", list(SPLITS))
def test_list_and_tensor_inputs_identical(recipe, splits):
    sp = SPLITS[splits]
    E = len(sp)
    base = make_layer(E)
    xs = torch.randn(sum(sp), 32)
    dy = torch.randn(sum(sp), 48)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ra = run(a, xs, sp, RECIPES[recipe], True, dy, steps=2)
    rb = run(b, xs, sp, RECIPES[recipe], False, dy, steps=2)
    assert_bits_equal(ra, rb, recipe)
    if RECIPES[recipe] is not None and RECIPES[recipe].delayed():
        for name in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv"):
            assert_bits_equal(getattr(a, name), getattr(b, name), name)
    for i, m in enumerate(sp):  # an expert with no tokens: zero weight gradient
        if m == 0:
            assert torch.count_nonzero(ra[2][i]) == 0 and torch.count_nonzero(ra[3][i]) == 0


@pytest.mark.parametrize("recipe", ["none", "current"])
def test_list_inputs_of_which_only_some_need_grad(recipe):
    """A list whose first tensor needs no gradient (its producer is frozen): the other experts'
    inputs still get theirs, the same bits as when every input needs one."""
    sp = [6, 0, 11]
    layer = make_layer(3)
    x, dy = torch.randn(17, 32), torch.randn(17, 48)
    want = run(layer, x, sp, RECIPES[recipe], True, dy)[1]
    inp = [t.clone().requires_grad_(i > 0) for i, t in enumerate(x.split(sp))]
    with _autocast(RECIPES[recipe]):
        y = layer(inp)
    torch.cat(y).backward(dy)
    assert inp[0].grad is None
    assert_bits_equal(torch.cat([t.grad for t in inp[1:]]), want[6:])


def test_list_outputs_are_views_of_one_buffer():
    layer = make_layer(3)
    xs = [torch.randn(m, 32) for m in (4, 0, 6)]
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        ys = layer(xs)
    assert [tuple(y.shape) for y in ys] == [(4, 48), (0, 48), (6, 48)]
    base = ys[0].untyped_storage().data_ptr()
    assert all(y.untyped_storage().data_ptr() == base for y in ys)


def test_gradcheck_float64_without_fp8():
    layer = make_layer(3, k=5, n=4, dtype=torch.float64)
    sp = [2, 0, 3]
    x = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    params = layer.weights() + layer.biases()

    # gradcheck passes its own copies of the params; route them through the module
    class Wrapped(torch.nn.Module):
        def forward(self, x, *p):
            return torch.func.functional_call(
                layer, {**{f"weight{i}": p[i] for i in range(3)},
                        **{f"bias{i}": p[3 + i] for i in range(3)}}, (x, sp))

    inputs = (x, *[p.detach().clone().requires_grad_() for p in params])
    assert torch.autograd.gradcheck(Wrapped(), inputs)
    xl = tuple(torch.randn(m, 5, dtype=torch.float64, requires_grad=True) for m in sp)
    assert torch.autograd.gradcheck(
        lambda *a: torch.cat(torch.func.functional_call(
            layer, {f"weight{i}": a[3 + i] for i in range(3)} | {f"bias{i}": a[6 + i] for i in range(3)},
            (list(a[:3]),))), xl + inputs[1:])


def _fp8_grid(shape, fmt, amax, seed):
    """Values exactly representable in ``fmt`` whose amax is ``amax`` (the format max: scale 1)."""
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
    v = rng.uniform(-amax, amax, size=shape).astype(dt).astype(np.float32)
    if v.size:
        v.reshape(-1)[0] = amax
    return torch.from_numpy(v)


@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3])
def test_fp8_matches_float64_on_prequantized_inputs(fmt):
    sp, k, n = [7, 0, 20], 32, 16
    layer = make_layer(3, k=k, n=n, bias=False)
    bwd = fmt.backward
    with torch.no_grad():
        for i, w in enumerate(layer.weights()):
            w.copy_(_fp8_grid((n, k), "e4m3", 448.0, i))
    x = torch.cat([_fp8_grid((m, k), "e4m3", 448.0, 10 + i) for i, m in enumerate(sp)])
    bwd_max = 57344.0 if bwd == "e5m2" else 448.0
    dy = torch.cat([_fp8_grid((m, n), bwd, bwd_max, 20 + i) for i, m in enumerate(sp)])
    y, dx, dw, _ = run(layer, x, sp, Float8CurrentScaling(fp8_format=fmt), False, dy)
    rows = np.cumsum([0] + sp)
    rtol, atol = (0.25, 0.125) if bwd == "e5m2" else (0.125, 0.0675)
    for i in range(3):
        xi, di = x[rows[i]:rows[i + 1]].double(), dy[rows[i]:rows[i + 1]].double()
        wi = layer.weights()[i].detach().double()
        torch.testing.assert_close(y[rows[i]:rows[i + 1]].double(), xi @ wi.T, rtol=0.125, atol=0.0675)
        torch.testing.assert_close(dx[rows[i]:rows[i + 1]].double(), di @ wi, rtol=rtol, atol=atol)
        torch.testing.assert_close(dw[i].double(), di.T @ xi, rtol=rtol, atol=atol)


@pytest.mark.parametrize("splits", ["uneven", "empty_middle"])
def test_fp8_equals_per_expert_loop_of_reference_steps(splits):
    """The module == quantize -> GEMM expert by expert with the NumPy reference ops, bit for bit
    (current scaling, HYBRID, fp32 activations, bias added after the GEMM as the module does)."""
    sp, k, n = SPLITS[splits], 32, 48
    layer = make_layer(len(sp))
    x = torch.randn(sum(sp), k)
    dy = torch.randn(sum(sp), n)
    y, dx, dw, db = run(layer, x, sp, Float8CurrentScaling(), False, dy)
    rows = np.cumsum([0] + sp)
    for i, m in enumerate(sp):
        xi, di = x[rows[i]:rows[i + 1]].numpy(), dy[rows[i]:rows[i + 1]].numpy()
        wi, bi = layer.weights()[i].detach().numpy(), layer.biases()[i].detach().numpy()
        xq = reference.multi_pad_cast_transpose([xi], fp8_format="e4m3", align=16)
        wq = reference.multi_pad_cast_transpose([wi], fp8_format="e4m3", align=1)
        dq = reference.multi_pad_cast_transpose([di], fp8_format="e5m2", align=16, column_sums=True)
        yi = reference.grouped_fprop(xq, wq, out_dtype="float32") + bi[None, :]
        assert np.array_equal(y[rows[i]:rows[i + 1]].numpy().view(np.uint32), yi.view(np.uint32))
        dxi = reference.grouped_dgrad(dq, wq, out_dtype="float32")
        assert np.array_equal(dx[rows[i]:rows[i + 1]].numpy().view(np.uint32), dxi.view(np.uint32))
        dwi = reference.grouped_wgrad(xq, dq, out_dtype="float32")[0]
        assert np.array_equal(dw[i].numpy().view(np.uint32), dwi.view(np.uint32))
        assert np.array_equal(db[i].numpy().view(np.uint32), dq.column_sums[0].view(np.uint32))


def test_current_scaling_qparams_reach_each_cast():
    """TransformerEngine's QParams per tensor role (input, weight, grad output): each cast gets
    its own amax_epsilon / power_2_scale. Options chosen so that every role's scale differs from
    what any other role's options would give: the module equals the per-expert reference steps
    with those options, bit for bit, and the scales are the ones the options imply."""
    from cugrouped.pytorch import QParams

    sp, k, n = [9, 0, 20], 32, 48
    # (two power-of-2 scales would give the same bits unless something under- or overflows: only
    # one role rounds to powers of two)
    qi, qw, qg = QParams(power_2_scale=True), QParams(amax_epsilon=100.0), \
        QParams(amax_epsilon=1e3)
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=qi, fp8_quant_fwd_weight=qw,
                                  fp8_quant_bwd_grad=qg)
    layer = make_layer(len(sp), bias=False)
    x = torch.randn(sum(sp), k)
    dy = torch.randn(sum(sp), n)
    y, dx, dw, _ = run(layer, x, sp, recipe, False, dy)
    rows = np.cumsum([0] + sp)
    opts = lambda q: dict(amax_epsilon=q.amax_epsilon, power_2_scale=q.power_2_scale)  # noqa: E731
    for i, m in enumerate(sp):
        xi, di = x[rows[i]:rows[i + 1]].numpy(), dy[rows[i]:rows[i + 1]].numpy()
        wi = layer.weights()[i].detach().numpy()
        xq = reference.multi_pad_cast_transpose([xi], fp8_format="e4m3", align=16, **opts(qi))
        wq = reference.multi_pad_cast_transpose([wi], fp8_format="e4m3", align=1, **opts(qw))
        dq = reference.multi_pad_cast_transpose([di], fp8_format="e5m2", align=16, **opts(qg))
        assert wq.scale[0] == np.float32(448 / np.float32(100.0))     # weight amax < 100
        assert dq.scale[0] == np.float32(57344 / np.float32(1000.0))  # grad amax < 1000
        if m:
            assert xq.scale[0] == np.exp2(np.floor(np.log2(448 / np.abs(xi).max())))
        yi = reference.grouped_fprop(xq, wq, out_dtype="float32")
        assert np.array_equal(y[rows[i]:rows[i + 1]].numpy().view(np.uint32), yi.view(np.uint32))
        dxi = reference.grouped_dgrad(dq, wq, out_dtype="float32")
        assert np.array_equal(dx[rows[i]:rows[i + 1]].numpy().view(np.uint32), dxi.view(np.uint32))
        dwi = reference.grouped_wgrad(xq, dq, out_dtype="float32")[0]
        assert np.array_equal(dw[i].numpy().view(np.uint32), dwi.view(np.uint32))
    # use_power_2_scales (TransformerEngine's switch) fills every QParams left None
    r = Float8CurrentScaling(use_power_2_scales=True, fp8_quant_bwd_grad=QParams())
    assert r.fp8_quant_fwd_inp == r.fp8_quant_fwd_weight == QParams(power_2_scale=True)
    assert r.fp8_quant_bwd_grad == QParams()
    assert Float8CurrentScaling().fp8_quant_fwd_inp == QParams()
    # derived QParams follow use_power_2_scales through dataclasses.replace; given ones stay
    import dataclasses
    r2 = dataclasses.replace(r, use_power_2_scales=False)
    assert r2.fp8_quant_fwd_inp == QParams() and r2.fp8_quant_bwd_grad == QParams()
    r3 = dataclasses.replace(Float8CurrentScaling(fp8_quant_fwd_inp=qi), use_power_2_scales=True)
    assert r3.fp8_quant_fwd_inp == qi and r3.fp8_quant_fwd_weight == QParams(power_2_scale=True)


@pytest.mark.parametrize("fuse_wgrad", [False, True])
def test_mmparams_choose_each_gemms_accumulation(monkeypatch, fuse_wgrad):
    """TransformerEngine's MMParams: use_split_accumulator=False is cuBLASLt's FP8 fast
    accumulation, per GEMM; the defaults (and delayed scaling) use it in fprop only."""
    from cugrouped.pytorch import MMParams
    from cugrouped.pytorch import _custom_ops

    seen = {}
    for name in ("grouped_fprop", "grouped_dgrad", "grouped_wgrad"):
        real = getattr(_custom_ops._ops, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen[_name] = kw["fast_accum"]
            return _real(*a, **kw)
        monkeypatch.setattr(_custom_ops._ops, name, spy)
    sp = [6, 0, 11]
    flipped = Float8CurrentScaling(fp8_gemm_fprop=MMParams(True), fp8_gemm_dgrad=MMParams(False),
                                   fp8_gemm_wgrad=MMParams(False))
    for rec, want in ((Float8CurrentScaling(), (True, False, False)),
                      (DelayedScaling(), (True, False, False)), (flipped, (False, True, True))):
        layer = make_layer(3, fuse_wgrad_accumulation=fuse_wgrad)
        for w in layer.weights():
            w.main_grad = torch.zeros_like(w)
        seen.clear()
        run(layer, torch.randn(17, 32), sp, rec, False)
        assert (seen["grouped_fprop"], seen["grouped_dgrad"], seen["grouped_wgrad"]) == want, rec
    with pytest.raises(TypeError, match="fp8_gemm_dgrad: expected a cugrouped.pytorch.MMParams"):
        Float8CurrentScaling(fp8_gemm_dgrad=True)


def test_bf16_fp8_with_fused_bias_close_to_float64():
    sp = [9, 3, 0, 21]
    layer = make_layer(4, dtype=torch.bfloat16)
    x = torch.randn(sum(sp), 32).bfloat16()
    y, dx, dw, db = run(layer, x, sp, Float8CurrentScaling(), False)
    assert y.dtype == dx.dtype == dw[0].dtype == db[0].dtype == torch.bfloat16
    rows = np.cumsum([0] + sp)
    ref = torch.cat([x[rows[i]:rows[i + 1]].double() @ w.detach().double().T + b.detach().double()
                     for i, (w, b) in enumerate(zip(layer.weights(), layer.biases()))])
    err = (y.double() - ref).norm() / ref.norm()
    assert err < 0.1                       # SQNR > 20 dB for E4M3 operands
    for i, m in enumerate(sp):
        torch.testing.assert_close(db[i].double(), torch.full((48,), float(m), dtype=torch.float64))


def test_weights_and_biases_are_the_parameters_now():
    """weights()/biases() read the parameters by names made once; a parameter replaced later is
    the one returned (and one held outside _parameters is still found)."""
    layer = make_layer(3)
    assert [id(w) for w in layer.weights()] == [id(getattr(layer, f"weight{i}")) for i in range(3)]
    new = torch.nn.Parameter(torch.zeros_like(layer.weight1))
    layer.weight1 = new
    assert layer.weights()[1] is new
    b = layer.bias2
    del layer._parameters["bias2"]
    object.__setattr__(layer, "bias2", b)          # as a wrapper holding it elsewhere would
    assert layer.biases()[2] is b


def test_is_first_microbatch_caches_fp8_weights():
    layer = make_layer(2)
    x = torch.randn(24, 32)
    rec = DelayedScaling(amax_history_len=4)
    kernels = lambda log: sum(1 for r in log if "pad_cast_transpose" in r.kernel)  # noqa: E731
    with fp8_autocast(fp8_recipe=rec), torch.no_grad():
        with record_launches() as log1:
            y1 = layer(x, [10, 14], is_first_microbatch=True)
        for w in layer.weights():        # would change the output if the weights were recast
            w.mul_(2)
        with record_launches() as log2:
            y2 = layer(x, [10, 14], is_first_microbatch=False)
        with record_launches() as log3:
            y3 = layer(x, [10, 14], is_first_microbatch=None)
    assert kernels(log1) == 2 and kernels(log2) == 1 and kernels(log3) == 2
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)


def test_cached_fp8_weights_serve_only_their_own_recipe():
    """``is_first_microbatch=False`` reuses the weights cast by the last True call only under
    the same recipe: under another one (here current scaling after delayed scaling) they are
    cast again, as with None."""
    layer = make_layer(2)
    x = torch.randn(10, 32)
    with torch.no_grad():
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            layer(x, [4, 6], is_first_microbatch=True)
        with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            y_false = layer(x, [4, 6], is_first_microbatch=False)
            y_none = layer(x, [4, 6], is_first_microbatch=None)
    assert_bits_equal(y_false, y_none)


def test_module_casts_drop_the_cached_fp8_weights():
    """``module.bfloat16()`` (any ``_apply``) gives new weights: the next
    ``is_first_microbatch=False`` call casts them instead of reusing the old copy."""
    layer = make_layer(2)
    x = torch.randn(10, 32)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()), torch.no_grad():
        layer(x, [4, 6], is_first_microbatch=True)
        layer.bfloat16()
        y_false = layer(x.bfloat16(), [4, 6], is_first_microbatch=False)
        y_none = layer(x.bfloat16(), [4, 6], is_first_microbatch=None)
    assert_bits_equal(y_false, y_none)


def test_a_call_without_caching_forgets_the_cached_fp8_weights():
    """``is_first_microbatch=None`` casts the weights and drops the cached copy: a later False
    call (after the weights changed, e.g. an optimizer step between) casts them again instead
    of reusing the copy of the last True call."""
    layer = make_layer(2)
    x = torch.randn(10, 32)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()), torch.no_grad():
        layer(x, [4, 6], is_first_microbatch=True)
        for w in layer.weights():
            w.mul_(2)
        y_none = layer(x, [4, 6], is_first_microbatch=None)
        y_false = layer(x, [4, 6], is_first_microbatch=False)
    assert_bits_equal(y_false, y_none)


def test_delayed_scaling_state_round_trips_through_state_dict(tmp_path):
    rec = DelayedScaling(amax_history_len=5, margin=1)
    layer = make_layer(3)
    x = torch.randn(30, 32)
    for _ in range(3):
        run(layer, x, [10, 5, 15], rec, False)
    path = tmp_path / "layer.pt"
    torch.save(layer.state_dict(), path)
    fresh = make_layer(3, seed=1)
    fresh.load_state_dict(torch.load(path, weights_only=False))
    for name in ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
        assert_bits_equal(getattr(fresh, name), getattr(layer, name), name)
    assert fresh._fp8_recipe == rec
    assert torch.count_nonzero(layer.fp8_amax_history[:, 3:]) == 0   # 3 steps of 5 filled
    assert torch.count_nonzero(layer.fp8_amax_history[:, :3]) > 0
    assert_bits_equal(run(fresh, x, [10, 5, 15], rec, False), run(layer, x, [10, 5, 15], rec, False))
    with pytest.raises(ValueError, match="experts"):
        make_layer(2).load_state_dict(layer.state_dict())


FP8_STATE = ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv")


def test_loaded_fp8_state_is_a_copy_of_the_checkpoints_tensors():
    """load_state_dict copies the FP8 extra state, as torch copies buffers: a layer loaded from
    another live layer's state_dict (an EMA or evaluation copy) shares none of its tensors, so
    the source's next scale update (in place) leaves the copy as loaded."""
    rec, sp = DelayedScaling(amax_history_len=4), [10, 5, 15]
    src, x = make_layer(3), torch.randn(30, 32)
    run(src, x, sp, rec, False)
    dst = make_layer(3, seed=1)
    dst.load_state_dict(src.state_dict())
    loaded = {n: getattr(dst, n).clone() for n in FP8_STATE}
    run(src, x * 64, sp, rec, False)
    assert not torch.equal(src.fp8_scale, loaded["fp8_scale"])
    for n in FP8_STATE:
        assert_bits_equal(getattr(dst, n), loaded[n], n)


def test_fp8_state_dict_keeps_the_states_recipe_fields():
    """The saved state names its recipe's format, margin, history length and amax algorithm;
    loading and saving again (a checkpoint conversion) keeps all of them."""
    rec = DelayedScaling(fp8_format=Format.E4M3, margin=2, amax_history_len=3,
                         amax_compute_algo="most_recent")
    layer = make_layer(3)
    run(layer, torch.randn(30, 32), [10, 5, 15], rec, False)
    once = make_layer(3, seed=1)
    once.load_state_dict(layer.state_dict())
    assert once.fp8_state().recipe == rec
    twice = make_layer(3, seed=2)
    twice.load_state_dict(once.state_dict())
    assert twice.fp8_state().recipe == rec
    assert twice.get_extra_state()["recipe"] == layer.get_extra_state()["recipe"]


def _with_amaxes(rows, cols, amaxes, seed):
    """Per expert, a ``(m, cols)`` block of values below ``amaxes[e]`` (a power of two) with one
    entry equal to it: the amaxes are known exactly."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for m, a in zip(rows, amaxes):
        t = (torch.rand(m, cols, generator=g) - 0.5) * a
        t[0, 0] = -a
        parts.append(t)
    return torch.cat(parts)


@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scales_follow_the_documented_rule(fmt, margin, algo):
    """DelayedScaling's rule, tensor by tensor (rows ``which·E + e``): ``scale = fp8_max /
    reduce(history) / 2^margin``, where fp8_max is E4M3's 448 for inputs and weights and, for
    grad outputs, E5M2's 57344 under HYBRID (448 under E4M3); ``reduce`` is the max over the
    window or the most recent amax. Amaxes are powers of two, so every scale is exact."""
    E, sp, n = 3, [4, 6, 2], 48
    rec = DelayedScaling(fp8_format=fmt, margin=margin, amax_history_len=2, amax_compute_algo=algo)
    layer = make_layer(E, bias=False)
    w_amax = [1.0, 0.5, 0.25]
    with torch.no_grad():
        for w, a, i in zip(layer.weights(), w_amax, range(E)):
            w.copy_(_with_amaxes([n], 32, [a], 10 + i))
    steps = [([2.0, 4.0, 8.0], [0.5, 1.0, 0.25]), ([1.0, 16.0, 2.0], [2.0, 0.5, 4.0])]
    for seed, (x_amax, dy_amax) in enumerate(steps):
        run(layer, _with_amaxes(sp, 32, x_amax, seed), sp, rec, False,
            dy=_with_amaxes(sp, n, dy_amax, 100 + seed))
    pick = (lambda a, b: max(a, b)) if algo == "max" else (lambda a, b: b)
    grad_max = 57344.0 if fmt is Format.HYBRID else 448.0
    want = [448.0 / pick(a, b) for a, b in zip(steps[0][0], steps[1][0])]
    want += [448.0 / a for a in w_amax]
    want += [grad_max / pick(a, b) for a, b in zip(steps[0][1], steps[1][1])]
    want = torch.tensor(want) / 2.0 ** margin
    assert_bits_equal(layer.fp8_scale, want)
    assert_bits_equal(layer.fp8_scale_inv, 1 / want)


def test_expert_without_tokens_keeps_its_delayed_scales():
    """An expert that receives no tokens for a whole amax window keeps its input and grad-output
    scales (TransformerEngine's rule) instead of falling back to 1; its weight scale still
    follows the weight. State rows are ``which·E + e`` (input, weight, grad output)."""
    rec = DelayedScaling(amax_history_len=1)
    layer = make_layer(3)
    x = torch.randn(30, 32)
    run(layer, x, [10, 5, 15], rec, False, dy=torch.full((30, 48), 1e-3))
    before = layer.fp8_scale.clone()
    assert torch.all(before != 1.0)                           # every scale was derived from an amax
    with torch.no_grad():
        layer.weight1.mul_(2.0)
    run(layer, x, [10, 0, 20], rec, False, dy=torch.full((30, 48), 1e-3))
    after = layer.fp8_scale
    assert after[1] == before[1] and after[7] == before[7]     # expert 1: input, grad output kept
    assert after[4] == before[4] / 2                           # expert 1's weight: amax doubled
    assert torch.equal(layer.fp8_scale_inv, 1 / after)


def test_an_idle_expert_keeps_its_amax_window_as_in_transformer_engine():
    """Steps in which an expert receives no tokens leave its input and grad-output histories and
    scales as they are (TransformerEngine's update skips a zero amax), so its old amaxes stay in
    the window; its weight, cast every step, rolls on."""
    rec, E = DelayedScaling(amax_history_len=4), 3
    layer = make_layer(E)
    x, dy = torch.randn(30, 32) * 8, torch.full((30, 48), 1e-3)
    run(layer, x, [10, 5, 15], rec, False, dy=dy)
    h0, s0 = layer.fp8_amax_history.clone(), layer.fp8_scale.clone()
    for _ in range(2):
        run(layer, x / 8, [10, 0, 20], rec, False, dy=dy)
    idle = [1, 2 * E + 1]                                   # expert 1: input, grad output
    assert torch.equal(layer.fp8_amax_history[idle], h0[idle])
    assert torch.equal(layer.fp8_scale[idle], s0[idle])
    assert not torch.equal(layer.fp8_amax_history[E + 1], h0[E + 1])     # its weight rolled
    assert not torch.equal(layer.fp8_amax_history[0], h0[0])             # expert 0 rolled


def test_delayed_scaling_state_repr_is_short_and_reads_no_device_data():
    from cugrouped.pytorch.fp8_state import DelayedScalingState

    # meta tensors hold no data: a repr that read any would raise
    st = DelayedScalingState(5, DelayedScaling(amax_history_len=16, margin=1), "meta")
    assert repr(st) == ("DelayedScalingState(experts=5, fp8_format=HYBRID, margin=1, "
                        "amax_history_len=16, device=meta)")


def test_dtype_casts_of_the_module_keep_the_fp8_state_float32():
    """``layer.bfloat16()`` / ``.double()`` cast the parameters, not the delayed-scaling state
    (which the casts and the update read as float32): its values survive bit for bit, and the
    next FP8 step runs."""
    rec = DelayedScaling(amax_history_len=4)
    layer = make_layer(3)
    x = torch.randn(30, 32)
    run(layer, x, [10, 5, 15], rec, False, steps=2)
    before = {n: getattr(layer, n).clone() for n in
              ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv")}
    for cast in (torch.nn.Module.double, torch.nn.Module.bfloat16):
        cast(layer)
        for name, t in before.items():
            assert getattr(layer, name).dtype == torch.float32, name
            assert_bits_equal(getattr(layer, name), t, name)
    assert layer.weight0.dtype == torch.bfloat16
    y = run(layer, x.bfloat16(), [10, 5, 15], rec, False)[0]
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


@pytest.mark.parametrize("recipe", ["none", "current"])
def test_fuse_wgrad_accumulation_accumulates_over_two_backwards(recipe):
    sp = [6, 0, 11]
    plain = make_layer(3)
    fused = make_layer(3, fuse_wgrad_accumulation=True)
    for w in fused.weights():
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x1, x2 = torch.randn(17, 32), torch.randn(17, 32)
    g1 = run(plain, x1, sp, RECIPES[recipe], False)[2]
    g2 = run(plain, x2, sp, RECIPES[recipe], False)[2]
    run(fused, x1, sp, RECIPES[recipe], False)
    run(fused, x2, sp, RECIPES[recipe], False)
    for i, w in enumerate(fused.weights()):
        assert w.grad is None and not hasattr(w, "grad_added_to_main_grad")
        torch.testing.assert_close(w.main_grad, g1[i] + g2[i], rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="weight0.main_grad"):
        run(make_layer(3, fuse_wgrad_accumulation=True), x1, sp, None, False)


@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_fused_wgrad_megatron_contract(recipe):
    """Megatron-LM's DDP marks its parameters with ``grad_added_to_main_grad = False`` and hooks
    their grad accumulators (with overlap_grad_reduce it asserts the grad is not None there):
    such a weight gets the flag set and a dummy gradient, as TransformerEngine does."""
    sp = [6, 0, 11]
    fused = make_layer(3, fuse_wgrad_accumulation=True)
    seen = []
    for w in fused.weights():
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
        w.grad_added_to_main_grad = False
        w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    run(fused, torch.randn(17, 32), sp, RECIPES[recipe], False)
    assert seen == [True] * 3
    for w in fused.weights():
        assert w.grad_added_to_main_grad and w.grad.shape == w.shape


@pytest.mark.parametrize("recipe", ["none", "current", "delayed"])
@pytest.mark.parametrize("delay", [False, True])
def test_fused_wgrad_megatron_fsdp_lazy_main_grad(recipe, delay):
    """Megatron-FSDP's parameters (``__fsdp_param__``) allocate main_grad only before backward
    and hand it out through ``get_main_grad()``: forward does not ask for it, backward does
    (also when the wgrad itself is deferred), and the wgrad lands in it."""
    sp = [6, 0, 11]
    plain = make_layer(3)
    fsdp = make_layer(3, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    asked = []
    for i, w in enumerate(fsdp.weights()):
        w.__fsdp_param__ = True

        def get_main_grad(w=w, i=i):
            asked.append(i)
            if not hasattr(w, "main_grad"):
                w.main_grad = torch.zeros_like(w)
            return w.main_grad
        w.get_main_grad = get_main_grad
    x, dy = torch.randn(17, 32), torch.randn(17, 48)
    want = run(plain, x, sp, RECIPES[recipe], False, dy)[2]
    with _autocast(RECIPES[recipe]):
        y = fsdp(x, sp)
    assert asked == [] and not any(hasattr(w, "main_grad") for w in fsdp.weights())
    y.backward(dy)
    assert asked == [0, 1, 2]
    fsdp.backward_dw()
    for w, g in zip(fsdp.weights(), want):
        torch.testing.assert_close(w.main_grad, g, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("recipe", ["none", "delayed", "current"])
@pytest.mark.parametrize("how", ["first_microbatch", "overwrite_main_grad"])
def test_fused_wgrad_overwrites_on_the_first_microbatch(recipe, how):
    """TransformerEngine: with ``is_first_microbatch=True`` (the first gradient of the step) or a
    weight marked ``overwrite_main_grad`` (Megatron-FSDP), main_grad is overwritten; later
    micro-batches add to it. An expert without tokens gets zeros when overwriting."""
    sp = [6, 0, 11]
    plain = make_layer(3)
    fused = make_layer(3, fuse_wgrad_accumulation=True)
    for w in fused.weights():
        w.main_grad = torch.full_like(w, 1000.0, dtype=torch.float32)
        if how == "overwrite_main_grad":
            w.overwrite_main_grad = True
    x1, x2 = torch.randn(17, 32), torch.randn(17, 32)
    first = True if how == "first_microbatch" else None
    g1 = run(plain, x1, sp, RECIPES[recipe], False, is_first_microbatch=first)[2]
    run(fused, x1, sp, RECIPES[recipe], False, is_first_microbatch=first)
    for i, w in enumerate(fused.weights()):
        torch.testing.assert_close(w.main_grad, g1[i], rtol=1e-6, atol=1e-5)
    if how == "first_microbatch":
        g2 = run(plain, x2, sp, RECIPES[recipe], False, is_first_microbatch=False)[2]
        run(fused, x2, sp, RECIPES[recipe], False, is_first_microbatch=False)
        for i, w in enumerate(fused.weights()):
            torch.testing.assert_close(w.main_grad, g1[i] + g2[i], rtol=1e-6, atol=1e-5)


def test_fused_wgrad_in_bf16_is_not_rounded_to_bf16():
    """Without FP8 the wgrad GEMM writes fp32 into main_grad: bf16 operands, fp32 products and
    sums (the reference twin here, cuBLASLt on CUDA), not a bf16 product added afterwards."""
    sp = [40, 0, 24]
    layer = make_layer(3, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    for w in layer.weights():
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x = torch.randn(64, 32).to(torch.bfloat16)
    dy = torch.randn(64, 48).to(torch.bfloat16)
    run(layer, x, sp, None, False, dy=dy)
    for w, xi, di in zip(layer.weights(), x.split(sp), dy.split(sp)):
        want = di.double().t() @ xi.double()
        err = (w.main_grad.double() - want).abs().max()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), err    # bf16 rounding: ~4e-3


@pytest.mark.parametrize("dtype,recipe,g_dtype", [
    (torch.bfloat16, "none", torch.bfloat16), (torch.bfloat16, "current", torch.bfloat16),
    (torch.bfloat16, "delayed", torch.bfloat16), (torch.float16, "current", torch.float16),
    (torch.float32, "none", torch.bfloat16), (torch.float32, "current", torch.bfloat16)])
def test_fused_wgrad_into_16_bit_main_grad(dtype, recipe, g_dtype):
    """Megatron keeps main_grad in the parameters' dtype when gradients are reduced in bf16
    (``grad_reduce_in_fp32=False``): the wgrad GEMM adds into it with an fp32 accumulation and
    one rounding of the sum. So the result is within half an ulp of the sum of the old value and
    the exact product, which the unfused layer (same operands, its gradient rounded once to the
    weights' dtype) gives to within another half ulp; and an expert without tokens keeps its
    main_grad, as with fp32."""
    sp = [40, 0, 24]
    rec = RECIPES[recipe]
    plain = make_layer(3, dtype=dtype, bias=False)
    fused = make_layer(3, dtype=dtype, bias=False, fuse_wgrad_accumulation=True)
    torch.manual_seed(5)
    old = [torch.randn(48, 32).to(g_dtype) for _ in range(3)]
    for w, o in zip(fused.weights(), old):
        w.main_grad = o.clone()
    x, dy = torch.randn(64, 32).to(dtype), torch.randn(64, 48).to(dtype)
    want = run(plain, x, sp, rec, False, dy)[2]
    run(fused, x, sp, rec, False, dy)
    # the product before any rounding to 16 bits: float64 without FP8; with FP8 the same layer in
    # float32 (same FP8 operands: the values are those of the 16-bit run), whose float32 gradient
    # is the reference's float64 product rounded once to float32
    if rec is None:
        prods = [d.double().t() @ xi.double() for xi, d in zip(x.split(sp), dy.split(sp))]
    else:
        twin = make_layer(3, dtype=torch.float32, bias=False)
        with torch.no_grad():
            for w32, w in zip(twin.weights(), plain.weights()):
                w32.copy_(w.float())
        prods = [g.double() for g in run(twin, x.float(), sp, rec, False, dy.float())[2]]
    ulp = 2.0 ** -(8 if g_dtype == torch.bfloat16 else 11)        # half an ulp, relative
    for i, (w, g, o, p) in enumerate(zip(fused.weights(), want, old, prods)):
        assert w.main_grad.dtype == g_dtype and w.grad is None
        got, total = w.main_grad.double(), o.double() + g.double()
        if sp[i] == 0:
            assert torch.equal(w.main_grad, o)
            continue
        bound = ulp * (g.double().abs() + total.abs()) + 1e-30
        assert ((got - total).abs() <= bound).all(), i
        # one rounding of the sum (a 16-bit product added afterwards would round twice)
        assert torch.equal(w.main_grad, (o.double() + p).to(g_dtype)), i


@pytest.mark.parametrize("dtype, g_dtype", [(torch.float32, torch.bfloat16),
                                            (torch.float64, torch.float32)])
def test_fused_wgrad_overwrites_main_grads_the_gemm_cannot_write(dtype, g_dtype):
    """The pairings the grouped GEMM has no output type for (float32 operands into a 16-bit
    main_grad; float64 operands) take torch's matmul: there too the first micro-batch overwrites
    main_grad (an expert without tokens gets zeros) and the next one adds to it."""
    sp = [6, 0, 11]
    plain = make_layer(3, dtype=dtype, bias=False)
    fused = make_layer(3, dtype=dtype, bias=False, fuse_wgrad_accumulation=True)
    for w in fused.weights():
        w.main_grad = torch.full_like(w, 1000.0, dtype=g_dtype)
    x1, x2 = torch.randn(17, 32).to(dtype), torch.randn(17, 32).to(dtype)
    g1 = run(plain, x1, sp, None, False, is_first_microbatch=True)[2]
    run(fused, x1, sp, None, False, is_first_microbatch=True)
    for w, g in zip(fused.weights(), g1):
        assert_bits_equal(w.main_grad, g.to(g_dtype))
    g2 = run(plain, x2, sp, None, False, is_first_microbatch=False)[2]
    run(fused, x2, sp, None, False, is_first_microbatch=False)
    for w, a, b in zip(fused.weights(), g1, g2):
        assert_bits_equal(w.main_grad, a.to(g_dtype).add_(b))


def test_main_grad_dtypes_are_checked():
    layer = make_layer(3, fuse_wgrad_accumulation=True)
    for w, dt in zip(layer.weights(), (torch.float32, torch.bfloat16, torch.float32)):
        w.main_grad = torch.zeros(w.shape, dtype=dt)
    with pytest.raises(ValueError, match="main_grad: every expert's main_grad must have the same"):
        run(layer, torch.randn(17, 32), [6, 0, 11], None, False)
    layer.weight1.main_grad = torch.zeros(48, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="weight1.main_grad: fuse_wgrad_accumulation=True needs a "
                                         "float32, bfloat16 or float16"):
        run(layer, torch.randn(17, 32), [6, 0, 11], None, False)


def test_no_grad_forward_leaves_the_delayed_scaling_state_alone():
    """Evaluation under ``torch.no_grad`` neither rolls the amax histories nor changes the scales
    (TransformerEngine updates only with grad enabled); with grad enabled and nothing needing a
    gradient the forward amaxes are folded in."""
    rec = DelayedScaling(amax_history_len=4)
    layer = make_layer(3)
    x = torch.randn(30, 32)
    run(layer, x, [10, 5, 15], rec, False)
    state = {n: getattr(layer, n).clone() for n in ("fp8_amax_history", "fp8_scale", "fp8_amax")}
    with torch.no_grad(), _autocast(rec):
        layer(x * 100, [10, 5, 15])
    for n, t in state.items():
        assert_bits_equal(getattr(layer, n), t, n)
    for p in layer.parameters():
        p.requires_grad_(False)
    with _autocast(rec):
        layer(x * 100, [10, 5, 15])
    assert not torch.equal(layer.fp8_scale, state["fp8_scale"])


def test_forwards_ahead_of_their_backwards_keep_every_amax():
    """Pipeline schedules run several forwards before their backwards (F1 F2 B1 B2): the scale
    update must see the maximum over both forwards' input amaxes, not only the last one."""
    rec = DelayedScaling(amax_history_len=4)
    layer = make_layer(3)
    big, small = torch.randn(30, 32) * 50, torch.randn(30, 32)
    outs = []
    with _autocast(rec):
        for x in (big, small):
            outs.append(layer(x.requires_grad_(), [10, 5, 15]))
    for y in outs:
        y.sum().backward()
    amax_big = torch.stack([t.abs().max() for t in big.detach().split([10, 5, 15])])
    torch.testing.assert_close(layer.fp8_amax_history[0:3, 0], amax_big, rtol=0, atol=0)
    # B2: no forward since B1's update, so its input amaxes are 0 and leave the window alone
    assert torch.all(layer.fp8_amax_history[0:3, 1:] == 0)


def test_forwards_ahead_of_their_backwards_keep_every_weight_amax():
    """The weights' amaxes are max-merged as the inputs' are: weights changed between two
    forwards (F1, W /= 4, F2, B1) leave the larger amax, F1's, for the scale update."""
    rec, sp = DelayedScaling(amax_history_len=4), [10, 5, 15]
    layer = make_layer(3)
    x = torch.randn(30, 32)
    amax_w = torch.stack([w.detach().abs().max() for w in layer.weights()])
    outs = []
    with _autocast(rec):
        outs.append(layer(x, sp))
        with torch.no_grad():
            for w in layer.weights():
                w.div_(4)
        outs.append(layer(x, sp))
    outs[0].sum().backward()
    assert_bits_equal(layer.fp8_amax_history[3:6, 0], amax_w)


def test_delayed_scaling_step_issues_no_extra_amax_ops():
    """The pending amax is max-merged by the cast kernel (amax_accumulate) and zeroed by the
    scale update's own launch (reset_amax): a delayed-scaling step runs no aten::maximum and no
    aten::zero_ (each was one extra launch per cast / per step on a GPU)."""
    import collections

    rec = DelayedScaling(amax_history_len=4)
    layer = make_layer(3)
    x = torch.randn(30, 32)
    with _autocast(rec):
        layer(x.requires_grad_(), [10, 5, 15]).sum().backward()     # state made, weights cast
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with _autocast(rec):
            y = layer(x, [10, 5, 15])
        y.sum().backward()
    ops = collections.Counter(e.name for e in prof.events())
    assert ops["aten::maximum"] == 0 and ops["aten::zero_"] == 0, ops


@pytest.mark.parametrize("recipe", ["none", "current", "delayed", "hp_wgrad", "dequantized"])
def test_torch_compile_fullgraph_matches_eager(recipe):
    torch._dynamo.reset()
    sp = [5, 0, 12]
    eager = make_layer(3)
    rec = {"hp_wgrad": DelayedScaling(amax_history_len=4,
                                      override_linear_precision=(False, False, True)),
           "dequantized": Float8CurrentScaling(backward_override="dequantized")}.get(
        recipe, RECIPES.get(recipe))
    if rec is not None and rec.delayed():
        eager.init_fp8_state(rec)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(17, 32)
    for _ in range(2):
        want = run(eager, x, sp, rec, False)
        got = run_compiled(compiled, compiled_layer, x, sp, rec)
        assert_bits_equal(got, want, recipe)
    if rec is not None and rec.delayed():
        assert_bits_equal(compiled_layer.fp8_scale, eager.fp8_scale)


@pytest.mark.parametrize("recipe", ["none", "current", "delayed"])
def test_torch_compile_fused_wgrad_matches_eager(recipe):
    """fuse_wgrad_accumulation under torch.compile(fullgraph=True): main_grad overwritten on the
    first micro-batch, then accumulated, bit for bit as in eager mode."""
    torch._dynamo.reset()
    sp = [5, 0, 12]
    eager = make_layer(3, fuse_wgrad_accumulation=True)
    if recipe == "delayed":
        eager.init_fp8_state(RECIPES[recipe])
    compiled_layer = copy.deepcopy(eager)
    for layer in (eager, compiled_layer):
        for w in layer.weights():
            w.main_grad = torch.full_like(w, 3.0)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(17, 32)
    for first in (True, False):
        run(eager, x, sp, RECIPES[recipe], False, is_first_microbatch=first)
        run(compiled, x, sp, RECIPES[recipe], False, is_first_microbatch=first)
    for a, b in zip(eager.weights(), compiled_layer.weights()):
        assert_bits_equal(a.main_grad, b.main_grad)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_torch_compile_delayed_without_state(fullgraph):
    """A training step compiled before the layer has its delayed-scaling state: a clear error
    naming the cure with fullgraph=True (made in the graph, the state would be an intermediate the
    backward mutates, which AOTAutograd refuses obscurely); otherwise that frame runs eagerly,
    makes the state, and the results equal eager mode's."""
    torch._dynamo.reset()
    rec, sp, x = RECIPES["delayed"], [5, 0, 12], torch.randn(17, 32)
    eager = make_layer(3)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(Exception, match=r"call layer\.init_fp8_state\(recipe\)"):
            run_compiled(compiled, compiled_layer, x, sp, rec)
        assert compiled_layer.fp8_state() is None
        return
    for _ in range(2):
        assert_bits_equal(run_compiled(compiled, compiled_layer, x, sp, rec),
                          run(eager, x, sp, rec, False), "delayed")
    assert_bits_equal(compiled_layer.fp8_scale, eager.fp8_scale)


def run_compiled(compiled, layer, x, sp, rec):
    inp = x.clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    with _autocast(rec):
        y = compiled(inp, sp)
    y.backward(torch.ones_like(y))
    return (y.detach(), inp.grad, [w.grad for w in layer.weights()], [b.grad for b in layer.biases()])


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_toy_moe_training_200_steps_fp8():
    """Two expert layers (up, down) with a ReLU, delayed scaling HYBRID, 200 Adam steps on a fixed
    regression task: the loss must fall and memory must not grow. Casts on the NumPy twins
    (cpu_cast_backend("reference"), the same bits as the emulated kernels) to keep it fast."""
    torch.manual_seed(0)
    E, k, h = 4, 16, 32
    up = GroupedLinear(E, k, h, device="cpu")
    down = GroupedLinear(E, h, k, device="cpu")
    teacher = [torch.randn(k, k) / 4 for _ in range(E)]
    sp = [9, 0, 17, 6]
    x = torch.randn(sum(sp), k)
    target = torch.cat([xi @ t for xi, t in zip(x.split(sp), teacher)])
    opt = torch.optim.Adam(list(up.parameters()) + list(down.parameters()), lr=3e-3)
    rec = DelayedScaling(amax_history_len=16)
    losses, mem, tensors = [], {}, {}
    with cpu_cast_backend("reference"), fp8_autocast(fp8_recipe=rec):
        for step in range(200):
            opt.zero_grad(set_to_none=True)
            y = down(torch.relu(up(x, sp)), sp)
            loss = torch.nn.functional.mse_loss(y, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step in (50, 199):
                gc.collect()
                mem[step] = _rss_mb()
                with warnings.catch_warnings():   # isinstance on deprecated torch proxies warns
                    warnings.simplefilter("ignore")
                    tensors[step] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), losses[::20]
    assert tensors[199] <= tensors[50], tensors      # nothing accumulates step after step
    assert mem[199] - mem[50] < 16, mem


BAD = [
    (lambda L: L(torch.randn(10, 31), [5, 5, 0]), ValueError, "inp: expected shape"),
    (lambda L: L(torch.randn(10, 32), [5, 4, 0]), ValueError, "m_splits: counts sum"),
    (lambda L: L(torch.randn(10, 32), [5, 6, -1]), ValueError, "m_splits: counts must be non-negative"),
    (lambda L: L(torch.randn(10, 32), [5, 5]), ValueError, "m_splits: expected 3 counts"),
    (lambda L: L(torch.randn(10, 32), [5, 5, 0, 0]), ValueError, "m_splits: expected 3 counts"),
    (lambda L: L(torch.randn(10, 32)), ValueError, "m_splits: required"),
    (lambda L: L(torch.randn(10, 32), [5.0, 5, 0]), TypeError, "m_splits: expected ints"),
    (lambda L: L(torch.randn(10, 32), torch.tensor([5.0, 5, 0])), TypeError, "m_splits"),
    (lambda L: L([torch.randn(3, 32)] * 2), ValueError, "inp: expected a list of 3"),
    (lambda L: L([torch.randn(3, 32), torch.randn(3, 32), torch.randn(1, 32)], [3, 1, 3]),
     ValueError, "m_splits: must be None"),
    (lambda L: L([torch.randn(3, 32), torch.randn(3, 32).double(), torch.randn(1, 32)]),
     TypeError, r"inp\[1\]: dtype"),
    (lambda L: L([torch.randn(3, 32), torch.randn(3, 32, device="meta"), torch.randn(1, 32)]),
     ValueError, r"inp\[1\]: on meta"),
    (lambda L: L([torch.randn(3, 32), torch.randn(3, 16), torch.randn(1, 32)]), ValueError, r"inp\[1\]"),
    (lambda L: L(torch.randn(10, 32).double(), [5, 5, 0]), TypeError, "inp: dtype"),
    (lambda L: L("x", [1]), TypeError, "inp"),
]


def test_recipe_bounds_are_inclusive():
    """The documented ranges include their ends: ``margin`` in [0, 64], ``amax_history_len`` in
    [1, 65536]; one past them is refused, and so is any FP8 dgrad override (only the wgrad GEMM
    may run in high precision, as in TransformerEngine)."""
    for cls in (DelayedScaling, Float8CurrentScaling):
        assert cls(margin=64).margin == 64
        with pytest.raises(ValueError, match="margin: expected an int in \\[0, 64\\]"):
            cls(margin=65)
        with pytest.raises(ValueError, match="override_linear_precision: only the wgrad GEMM"):
            cls(override_linear_precision=(False, True, False))
    assert DelayedScaling(amax_history_len=1 << 16).amax_history_len == 65536
    for bad in (0, (1 << 16) + 1):
        with pytest.raises(ValueError, match="amax_history_len"):
            DelayedScaling(amax_history_len=bad)


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_input_names_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call(make_layer(3))


def test_fp8_needs_multiples_of_16():
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        with pytest.raises(ValueError, match="in_features: .*FP8 GEMMs need a multiple of 16, got 24"):
            make_layer(2, k=24)(torch.randn(4, 24), [2, 2])
        with pytest.raises(ValueError, match="out_features"):
            make_layer(2, n=40)(torch.randn(4, 32), [2, 2])
        with pytest.raises(TypeError, match="inp: FP8 needs"):
            make_layer(2, dtype=torch.float64)(torch.randn(4, 32).double(), [2, 2])


def test_constructor_and_recipe_errors():
    with pytest.raises(ValueError, match="in_features"):
        GroupedLinear(2, 0, 16, device="cpu")
    with pytest.raises(ValueError, match="tp_size"):
        GroupedLinear(2, 16, 16, device="cpu", tp_size=2)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(TypeError, match="fp8_format"):
        Float8CurrentScaling(fp8_format="hybrid")
    for cls in (DelayedScaling, Float8CurrentScaling):
        with pytest.raises(ValueError, match="fp8_format: pure E5M2 training is not supported"):
            cls(fp8_format=Format.E5M2)
    with pytest.raises(TypeError, match="fp8_recipe"):
        with fp8_autocast(fp8_recipe="delayed"):
            pass
    with pytest.raises(ValueError, match="scaling_factor_compute_algo"):
        DelayedScaling(scaling_factor_compute_algo=lambda amax, scale, fp8_max, recipe: scale)
    with pytest.raises(TypeError, match="reduce_amax"):
        DelayedScaling(reduce_amax=1)
    for cls in (DelayedScaling, Float8CurrentScaling):
        with pytest.raises(TypeError, match="fp8_dpa"):
            cls(fp8_dpa="yes")
        with pytest.raises(TypeError, match="override_linear_precision: expected a tuple"):
            cls(override_linear_precision=[False, False, False])
        with pytest.raises(ValueError, match="override_linear_precision: only the wgrad GEMM"):
            cls(override_linear_precision=(True, False, False))
    with pytest.raises(ValueError, match="backward_override: delayed scaling supports only None"):
        DelayedScaling(backward_override="high_precision")
    with pytest.raises(ValueError, match="backward_override: expected one of"):
        Float8CurrentScaling(backward_override="fp32")
    from cugrouped.pytorch import QParams
    with pytest.raises(ValueError, match="amax_epsilon"):
        QParams(amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="power_2_scale"):
        QParams(power_2_scale="yes")
    with pytest.raises(ValueError, match="stochastic_rounding: an FP4 option"):
        QParams(stochastic_rounding=True)
    with pytest.raises(TypeError, match="fp8_quant_bwd_grad: expected a cugrouped.pytorch.QParams"):
        Float8CurrentScaling(fp8_quant_bwd_grad={"power_2_scale": True})
    with pytest.raises(TypeError, match="use_power_2_scales"):
        Float8CurrentScaling(use_power_2_scales=1)
    # TransformerEngine's positional order (sequence_parallel fourth) must not silently mean bias
    with pytest.raises(TypeError, match="positional"):
        GroupedLinear(2, 16, 16, False, device="cpu")
    with pytest.raises(TypeError, match=r"params_dtype: expected a torch.dtype .*'bfloat16'"):
        GroupedLinear(2, 16, 16, params_dtype="bfloat16", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda' .*device='cpu'"):
            GroupedLinear(2, 16, 16)
    assert GroupedLinear(2, 16, 16, device=None).weight0.device == torch.get_default_device()
    assert GroupedLinear(2, 16, 16, device="cpu", name="experts.fc1").name == "experts.fc1"
    with pytest.raises(TypeError, match="name: expected None or a str"):
        GroupedLinear(2, 16, 16, device="cpu", name=1)


def test_autocast_is_fp8_autocast_under_te_names():
    """TransformerEngine 2.x's ``autocast(enabled, calibrating, recipe, amax_reduction_group)``."""
    from cugrouped.pytorch import autocast

    sp, x, rec = [5, 0, 9], torch.randn(14, 32), DelayedScaling(amax_history_len=4)
    a, b = make_layer(3), make_layer(3)
    for _ in range(2):
        with autocast(enabled=True, recipe=rec, amax_reduction_group=None):
            ya = a(x, sp)
        with fp8_autocast(fp8_recipe=rec):
            yb = b(x, sp)
        assert_bits_equal(ya, yb)
        ya.sum().backward()
        yb.sum().backward()
    assert_bits_equal(a.fp8_scale, b.fp8_scale)
    with autocast(enabled=False, recipe=rec):
        assert get_fp8_recipe() is None
    with pytest.raises(TypeError, match="calibrating: expected a bool"):
        with fp8_autocast(calibrating=1):
            pass


@pytest.mark.parametrize("grad", [True, False])
def test_calibration_records_forward_scales_in_high_precision(grad):
    """fp8_autocast(enabled=False, calibrating=True): outputs of the plain layer, and the
    delayed-scaling state an FP8 forward without backward leaves (input and weight amaxes
    merged, their scales updated), under no_grad too; FP8 inference afterwards then gives the
    same bits as after those FP8 forwards. Current scaling has nothing to record."""
    from cugrouped.pytorch import autocast

    rec = DelayedScaling(amax_history_len=4)
    sp = [5, 0, 9]
    plain, cal, fp8 = make_layer(3), make_layer(3), make_layer(3)
    for p in fp8.parameters():
        p.requires_grad_(False)          # an FP8 forward that no backward follows
    for step in range(3):
        x = torch.randn(14, 32) * (step + 1)
        with torch.set_grad_enabled(grad), autocast(enabled=False, calibrating=True, recipe=rec):
            y = cal(x, sp)
        assert_bits_equal(y, plain(x, sp))
        with fp8_autocast(fp8_recipe=rec):
            fp8(x, sp)
    for name in ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
        assert_bits_equal(getattr(cal, name), getattr(fp8, name), name)
    # inputs (expert 1 has no rows: its scale stays 1) and weights updated; grads untouched
    assert cal.fp8_scale[[0, 2, 3, 4, 5]].ne(1).all() and cal.fp8_scale[[1, 6, 7, 8]].eq(1).all()
    x = torch.randn(14, 32)
    with torch.no_grad(), fp8_autocast(fp8_recipe=rec):
        assert_bits_equal(cal(x, sp), fp8(x, sp))
    fresh = make_layer(3)
    with fp8_autocast(enabled=False, fp8_recipe=Float8CurrentScaling(), calibrating=True):
        assert_bits_equal(fresh(x, sp), plain(x, sp))
    assert fresh.fp8_state() is None


def test_calibration_drops_the_cached_fp8_weights():
    """Calibration moves the weights' scales: a later ``is_first_microbatch=False`` forward casts
    the weights with the calibrated scales (as None does) instead of reusing a copy cast with
    the old ones."""
    rec, sp = DelayedScaling(amax_history_len=4), [5, 0, 9]
    layer = make_layer(3)
    x = torch.randn(14, 32)
    with torch.no_grad():
        with fp8_autocast(fp8_recipe=rec):
            layer(x, sp, is_first_microbatch=True)
        scale = layer.fp8_scale.clone()
        with fp8_autocast(enabled=False, fp8_recipe=rec, calibrating=True):
            layer(x, sp)
        assert not torch.equal(layer.fp8_scale[3:6], scale[3:6])
        with fp8_autocast(fp8_recipe=rec):
            assert_bits_equal(layer(x, sp, is_first_microbatch=False),
                              layer(x, sp, is_first_microbatch=None))


def test_loads_a_transformer_engine_checkpoint_without_fp8_state():
    """TransformerEngine's GroupedLinear has the same parameter names; without FP8 its extra
    state is an empty uint8 tensor: such a checkpoint loads. Its serialized FP8 state does not
    load directly (its layout depends on TE's version: test_pytorch_te_checkpoint.py converts
    it), with an error that says what to do."""
    src = make_layer(3, seed=4)
    te_style = {**{k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")},
                "_extra_state": torch.empty(0, dtype=torch.uint8)}
    dst = make_layer(3)
    dst.init_fp8_state(DelayedScaling())
    dst.load_state_dict(te_style)
    assert dst.fp8_state() is None
    assert all(torch.equal(a, b) for a, b in zip(dst.parameters(), src.parameters()))
    # TE's payload of a stateless recipe (current, block, MXFP8 scaling) holds no scales: it
    # loads as no FP8 state; delayed scaling's (pickled in a uint8 tensor, or torch.save'd into
    # BytesIO by older TE) is refused with what to do, and the advice works
    import pickle
    blob = lambda obj: torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # noqa
    dst.init_fp8_state(DelayedScaling())
    dst.load_state_dict({**te_style, "_extra_state": blob(
        {"recipe": "Float8CurrentScaling()", "extra_fp8_variables": {"num_gemms": 3}})})
    assert dst.fp8_state() is None
    delayed = {"scale_fwd": torch.ones(6), "amax_history_fwd": torch.zeros(16, 6),
               "scale_bwd": torch.ones(3), "amax_history_bwd": torch.zeros(16, 3)}
    old = io.BytesIO()
    torch.save(delayed, old)
    for state in (blob(delayed), old):
        with pytest.raises(ValueError, match=r"TransformerEngine's delayed-scaling state.*"
                                             r"from_te_state_dict.*te_version.*"
                                             r"torch.empty\(0, dtype=torch.uint8\)"):
            dst.load_state_dict({**te_style, "_extra_state": state})
    dst.load_state_dict({**te_style, "_extra_state": torch.empty(0, dtype=torch.uint8)})


def test_distributed_checkpoint_round_trip(tmp_path):
    """torch.distributed.checkpoint (single process): weights and the delayed-scaling state come
    back bit for bit into a fresh layer whose FP8 state was created first."""
    import torch.distributed.checkpoint as dcp

    rec, sp = DelayedScaling(amax_history_len=4), [4, 0, 6]
    src = make_layer(3)
    for _ in range(2):
        run(src, torch.randn(10, 32), sp, rec, False)
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path), no_dist=True)
    dst = make_layer(3, seed=1)
    dst.init_fp8_state(rec)
    sd = dst.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path), no_dist=True)
    dst.load_state_dict(sd)
    for name in ("weight0", "bias2", "fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
        assert_bits_equal(getattr(dst, name).detach(), getattr(src, name).detach(), name)


def test_inference_mode_then_training():
    """torch.inference_mode first (the FP8 state made there, a weight copy cached with
    is_first_microbatch=True), then training that reuses the cache: autograd may not save
    inference tensors, so neither the state nor a copy used for training is one; the training
    step equals that of a layer that never ran in inference mode."""
    rec, sp = DelayedScaling(amax_history_len=4), [5, 0, 9]
    x = torch.randn(14, 32)
    a, b = make_layer(3), make_layer(3)
    with torch.inference_mode(), fp8_autocast(fp8_recipe=rec):
        a(x, sp, is_first_microbatch=True)
    assert not a.fp8_scale.is_inference()
    with torch.no_grad(), fp8_autocast(fp8_recipe=rec):
        b(x, sp, is_first_microbatch=True)
    assert_bits_equal(run(a, x, sp, rec, False, is_first_microbatch=False),
                      run(b, x, sp, rec, False, is_first_microbatch=False))


def test_megatron_recipe_arguments_are_accepted():
    """Megatron-LM builds TransformerEngine recipes with these arguments (fp8_wgrad on)."""
    rec = DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_compute_algo="max",
                         amax_history_len=16, override_linear_precision=(False, False, False),
                         fp8_dpa=False, fp8_mha=False)
    cur = Float8CurrentScaling(fp8_format=Format.E4M3, fp8_dpa=True)
    sp = [5, 0, 9]
    x = torch.randn(14, 32)
    for r, plain in ((rec, DelayedScaling(amax_history_len=16)),
                     (cur, Float8CurrentScaling(fp8_format=Format.E4M3))):
        assert_bits_equal(run(make_layer(3), x, sp, r, False), run(make_layer(3), x, sp, plain, False))


# ---------------------------------------------------------------------------------------------
# GPU (run by scripts/gpu_check.sh)

@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["none", "delayed", "current"])
def test_gpu_list_and_tensor_identical_and_close_to_cpu(recipe):
    sp = [0, 37, 5, 64]
    base = make_layer(4, k=64, n=32, dtype=torch.bfloat16)
    x = torch.randn(sum(sp), 64).bfloat16()
    dy = torch.randn(sum(sp), 32).bfloat16()
    a = copy.deepcopy(base).cuda()
    b = copy.deepcopy(base).cuda()
    # views of one tensor: without FP8 the GEMMs are torch's, whose cuBLAS algorithm may depend
    # on the operands' address alignment, which then must not differ between the two forms
    ra = run(a, x.cuda(), sp, RECIPES[recipe], True, dy.cuda(), steps=2, list_views=True)
    rb = run(b, x.cuda(), sp, RECIPES[recipe], False, dy.cuda(), steps=2)
    assert_bits_equal(ra, rb, recipe)
    rc = run(copy.deepcopy(base), x, sp, RECIPES[recipe], False, dy, steps=2)
    for g, c in zip(ra, rc):
        for u, v in zip(g if isinstance(g, list) else [g], c if isinstance(c, list) else [c]):
            torch.testing.assert_close(u.cpu().float(), v.float(), rtol=0.125, atol=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_gpu_fused_wgrad_overwrite_then_accumulate_matches_cpu(recipe, g_dtype):
    """fuse_wgrad_accumulation on CUDA (the non-FP8 path goes through grouped_wgrad into the
    main_grad, the FP8 path through the FP8 wgrad with beta 0 / 1; a bf16 main_grad is the
    GEMM's bf16 C and D): the first micro-batch overwrites, the second adds; close to the same
    steps on the CPU."""
    sp = [0, 37, 5, 64]
    base = make_layer(4, k=64, n=32, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    x1, x2 = torch.randn(sum(sp), 64).bfloat16(), torch.randn(sum(sp), 64).bfloat16()
    dy = torch.randn(sum(sp), 32).bfloat16()
    grads = []
    for dev in ("cuda", "cpu"):
        layer = copy.deepcopy(base).to(dev)
        for w in layer.weights():
            w.main_grad = torch.full(w.shape, 7.0, device=dev, dtype=g_dtype)
            w.grad_added_to_main_grad = False
        run(layer, x1.to(dev), sp, RECIPES[recipe], False, dy.to(dev), is_first_microbatch=True)
        run(layer, x2.to(dev), sp, RECIPES[recipe], False, dy.to(dev), is_first_microbatch=False)
        assert all(w.grad_added_to_main_grad for w in layer.weights())
        assert all(w.main_grad.dtype == g_dtype for w in layer.weights())
        grads.append([w.main_grad.cpu() for w in layer.weights()])
    for g, c in zip(*grads):
        torch.testing.assert_close(g, c, rtol=0.125, atol=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True], ids=["grads", "main_grad"])
@pytest.mark.parametrize("list_mode", [False, True], ids=["tensor", "list"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_gpu_direct_routes_give_the_public_ops_bits(recipe, list_mode, fuse):
    """The layer's casts and GEMMs by their direct routes (no checks of the layer's own buffers;
    cugrouped/ops/_gemm_direct.py) and through the public ops give the same bits: output, input,
    weight and bias gradients (or the main_grads), over two steps."""
    from unittest import mock

    from cugrouped.pytorch import _custom_ops as cops

    sp = [0, 37, 5, 64]
    base = make_layer(4, k=64, n=32, dtype=torch.bfloat16, fuse_wgrad_accumulation=fuse)
    x = torch.randn(sum(sp), 64).bfloat16().cuda()
    dy = torch.randn(sum(sp), 32).bfloat16().cuda()
    res = []
    for direct in (True, False):
        layer = copy.deepcopy(base).cuda()
        for w in layer.weights() if fuse else ():
            w.main_grad = torch.zeros(w.shape, device="cuda", dtype=torch.float32)
        with mock.patch.object(cops, "DIRECT_GEMMS", direct), \
                mock.patch.object(cops, "DIRECT_CASTS", direct):
            out = run(layer, x, sp, RECIPES[recipe], list_mode, dy, steps=2)
        res.append(list(out[:2]) + [[w.main_grad for w in layer.weights()] if fuse else out[2],
                                    out[3]])
    assert_bits_equal(res[0], res[1], recipe)


@pytest.mark.gpu
def test_gpu_no_host_sync_in_forward_and_backward():
    layer = make_layer(4, k=64, n=32, dtype=torch.bfloat16).cuda()
    x = torch.randn(100, 64, device="cuda").bfloat16().requires_grad_()
    rec = DelayedScaling(amax_history_len=4)
    with fp8_autocast(fp8_recipe=rec):
        layer(x, [10, 20, 30, 40]).sum().backward()     # warm-up: compiles, allocates
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = layer(x, [10, 20, 30, 40])
            y.backward(torch.ones_like(y))
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_torch_compile_and_training_step():
    torch._dynamo.reset()
    layer = make_layer(4, k=64, n=32, dtype=torch.bfloat16).cuda()
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    x = torch.randn(60, 64, device="cuda").bfloat16()
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        assert_bits_equal(compiled(x, [0, 30, 10, 20]), layer(x, [0, 30, 10, 20]))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_gpu_training_step_replays_in_a_cuda_graph(recipe):
    """A whole FP8 training step (forward, input and parameter gradients) captured with
    torch.cuda.graph after warm-up steps on the capturing stream (nothing of cugrouped's is
    allocated during the capture), replayed over new bytes in the captured input and grad output:
    each replay gives an eager step's bits on the same data, the eager twin a copy of the layer
    taken before the capture (with delayed scaling, the same amax history: each replay and each
    eager step roll it alike)."""
    sp = [0, 48, 16, 80]
    layer = make_layer(4, k=64, n=32, dtype=torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(sum(sp), 64, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(sum(sp), 32, device="cuda", generator=g).bfloat16()
    rec = RECIPES[recipe]

    def step(lay, xi):
        with fp8_autocast(fp8_recipe=rec):
            y = lay(xi, sp)
        return (y, *torch.autograd.grad(y, [xi, *lay.parameters()], dy))

    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        for _ in range(2):
            step(layer, x)
    torch.cuda.current_stream().wait_stream(cap)
    torch.cuda.synchronize()
    twin = copy.deepcopy(layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=cap):
        static = step(layer, x)
    for seed in (6, 7):
        g.manual_seed(seed)
        with torch.no_grad():
            x.copy_(torch.randn(sum(sp), 64, device="cuda", generator=g))
            dy.copy_(torch.randn(sum(sp), 32, device="cuda", generator=g))
        graph.replay()
        want = step(twin, x.detach().clone().requires_grad_())
        torch.cuda.synchronize()
        for i, (got, ref) in enumerate(zip(static, want)):
            assert_bits_equal(got, ref, f"replay {seed}, output {i}")


# ---------------------------------------------------------------------------------------------
# TransformerEngine / Megatron-LM parity

class _FakeGroup:
    def __init__(self, size):
        self.size = size


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed looking initialized, with groups of any size (``_FakeGroup``)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size)


@pytest.mark.parametrize("kw", [
    dict(parallel_mode="column", tp_size=1), dict(parallel_mode="row", sequence_parallel=True),
    dict(parallel_mode=None, tp_group=_FakeGroup(1), sequence_parallel=True),
    dict(get_rng_state_tracker=None, rng_tracker_name=None, ub_overlap_rs=False,
         ub_overlap_ag=False, ub_name="fc1", delay_wgrad_compute=False, save_original_input=False),
])
def test_megatron_expert_kwargs_are_noops_at_tensor_parallel_size_1(kw, fake_dist):
    sp = [5, 0, 12]
    plain, layer = make_layer(3), make_layer(3, **kw)
    assert layer.tp_size == 1 and layer.sequence_parallel is False
    for a, b in zip(plain.parameters(), layer.parameters()):
        assert torch.equal(a, b)
    x = torch.randn(17, 32)
    for rec in ("none", "current"):
        assert_bits_equal(run(layer, x, sp, RECIPES[rec], False), run(plain, x, sp, RECIPES[rec], False))
    dim = 1 if kw.get("parallel_mode") == "row" else 0
    assert all(w.tensor_model_parallel and w.partition_dim == dim for w in layer.weights())


@pytest.mark.parametrize("kw, exc, match", [
    (dict(tp_size=2), ValueError, "tp_size: tensor parallelism is not supported"),
    (dict(tp_size=0), ValueError, "tp_size: expected a positive int"),
    (dict(tp_group=_FakeGroup(2)), ValueError, "tp_group: tensor parallelism .* 2 ranks"),
    (dict(tp_group=_FakeGroup(2), tp_size=1, parallel_mode="column"), ValueError, "tp_group"),
    (dict(parallel_mode="diagonal"), ValueError, "parallel_mode: expected None, 'column' or 'row'"),
    (dict(ub_overlap_ag=True), ValueError, "ub_overlap_rs, ub_overlap_ag"),
    (dict(get_rng_state_tracker=3), TypeError, "get_rng_state_tracker"),
    (dict(rng_tracker_name=3), TypeError, "rng_tracker_name"),
])
def test_tensor_parallelism_above_1_raises_naming_the_argument(kw, exc, match, fake_dist):
    with pytest.raises(exc, match=match):
        GroupedLinear(2, 16, 16, device="cpu", **kw)


def test_tp_group_needs_torch_distributed():
    with pytest.raises(ValueError, match="tp_group: given, but torch.distributed is not initialized"):
        GroupedLinear(2, 16, 16, device="cpu", tp_group=_FakeGroup(1))


class _Tracker:
    """Megatron's CUDA RNG tracker, on the CPU generator: ``fork(name)`` runs the block from the
    named state and keeps the outer state untouched."""

    def __init__(self):
        self.states, self.forks = {}, []

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forks.append(name)
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states.setdefault(name, torch.manual_seed(1234).get_state()))
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@pytest.mark.parametrize("name", [None, "expert-parallel-rng"])
def test_weights_initialised_inside_the_rng_tracker_fork(name):
    tracker = _Tracker()
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    layer = GroupedLinear(3, 16, 32, device="cpu", get_rng_state_tracker=lambda: tracker,
                          rng_tracker_name=name)
    assert torch.equal(torch.get_rng_state(), outer)           # the default stream is untouched
    assert tracker.forks == [name or "model-parallel-rng"]
    torch.manual_seed(1234)
    want = GroupedLinear(3, 16, 32, device="cpu")
    for a, b in zip(layer.weights(), want.weights()):
        assert torch.equal(a, b)
    assert all(torch.count_nonzero(b) == 0 for b in layer.biases())


def test_meta_construction_then_to_empty_and_reset_parameters():
    layer = GroupedLinear(3, 32, 48, device="meta", init_method=torch.nn.init.ones_)
    assert all(p.is_meta for p in layer.parameters())
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    want = GroupedLinear(3, 32, 48, device="cpu", init_method=torch.nn.init.ones_)
    for (na, a), (nb, b) in zip(layer.named_parameters(), want.named_parameters()):
        assert na == nb and torch.equal(a, b), na
    assert all(w.tensor_model_parallel for w in layer.weights())
    torch.manual_seed(0)
    layer = GroupedLinear(2, 32, 48, device="meta").to_empty(device="cpu")
    layer.reset_parameters()
    torch.manual_seed(0)
    assert torch.equal(layer.weight1, GroupedLinear(2, 32, 48, device="cpu").weight1)
    x = torch.randn(10, 32)
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
        y = layer(x, [4, 6])
    assert y.shape == (10, 48) and torch.isfinite(y).all()


def test_reset_parameters_drops_the_cached_fp8_weights():
    layer = make_layer(2)
    x = torch.randn(10, 32)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()), torch.no_grad():
        y1 = layer(x, [4, 6], is_first_microbatch=True)
        layer.reset_parameters()
        y2 = layer(x, [4, 6], is_first_microbatch=False)
        y3 = layer(x, [4, 6], is_first_microbatch=None)
    assert not torch.equal(y1, y2)        # recast, not the stale cached copy
    assert_bits_equal(y2, y3)             # (the zeroed biases alone would change y2)
    assert all(torch.count_nonzero(b) == 0 for b in layer.biases())


@pytest.mark.parametrize("recipe", ["none", "current", "delayed"])
@pytest.mark.parametrize("list_mode", [False, True])
def test_return_bias_returns_the_biases_unadded(recipe, list_mode):
    """TransformerEngine's ``return_bias``: forward returns ``(out, [bias_i])`` without adding
    them; adding them afterwards gives the plain layer's output and the same gradients."""
    sp = [6, 0, 11]
    plain, layer = make_layer(3), make_layer(3, return_bias=True)
    x, dy = torch.randn(17, 32), torch.randn(17, 48)
    want = run(plain, x, sp, RECIPES[recipe], list_mode, dy)
    inp = [t.clone().requires_grad_() for t in x.split(sp)] if list_mode else x.clone().requires_grad_()
    with _autocast(RECIPES[recipe]):
        out, biases = layer(inp, None if list_mode else sp)
    assert len(biases) == 3 and all(b is p for b, p in zip(biases, layer.biases()))
    parts = out if list_mode else out.split(sp)
    y = torch.cat([p + b for p, b in zip(parts, biases)])
    y.backward(dy)
    dx = torch.cat([t.grad for t in inp]) if list_mode else inp.grad
    got = (y.detach(), dx, [w.grad for w in layer.weights()], [b.grad for b in layer.biases()])
    if recipe == "none":      # addmm vs matmul + add: the same math, not the same rounding
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    else:                     # FP8 adds the fp32 bias after the GEMM: bit for bit
        assert_bits_equal(got[:3], want[:3], recipe)
        # dbias: the cast kernel's column sums vs autograd's sum, same values up to the order
        torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-5)


def test_return_bias_without_bias_returns_empty_tensors():
    layer = make_layer(2, bias=False, return_bias=True)
    out, biases = layer(torch.randn(5, 32), [2, 3])
    assert out.shape == (5, 48) and len(biases) == 2
    assert all(b.numel() == 0 and b.dtype == torch.float32 for b in biases)
    # in the activation dtype, also when it is not torch's default dtype
    layer = make_layer(2, bias=False, return_bias=True, dtype=torch.bfloat16)
    out, biases = layer(torch.randn(5, 32, dtype=torch.bfloat16), [2, 3])
    assert all(b.numel() == 0 and b.dtype == torch.bfloat16 for b in biases)
    with torch.autocast("cpu", dtype=torch.float16):
        out, biases = make_layer(2, bias=False, return_bias=True)(torch.randn(5, 32), [2, 3])
    assert out.dtype == torch.float16 and all(b.dtype == torch.float16 for b in biases)


@pytest.mark.parametrize("recipe", ["none", "current", "delayed"])
@pytest.mark.parametrize("shape", [(4, 5, 32), (2, 2, 5, 32), (20, 1, 32)])
def test_more_than_2_dims_flattened_like_transformer_engine(recipe, shape):
    sp = [7, 0, 13]
    flat_layer, layer = make_layer(3), make_layer(3)
    x, dy = torch.randn(20, 32), torch.randn(20, 48)
    want = run(flat_layer, x, sp, RECIPES[recipe], False, dy)
    xn = x.reshape(shape).clone().requires_grad_()
    with _autocast(RECIPES[recipe]):
        y = layer(xn, sp)
    assert y.shape == (*shape[:-1], 48)
    y.backward(dy.reshape(y.shape))
    assert xn.grad.shape == shape
    got = (y.detach().reshape(20, 48), xn.grad.reshape(20, 32), [w.grad for w in layer.weights()],
           [b.grad for b in layer.biases()])
    assert_bits_equal(got, want, recipe)


def test_more_than_2_dims_non_contiguous_and_bad_shapes():
    layer = make_layer(3)
    x = torch.randn(32, 4, 5).permute(1, 2, 0)            # (4, 5, 32), not contiguous
    torch.testing.assert_close(layer(x, [7, 0, 13]), layer(x.reshape(20, 32), [7, 0, 13]).view(4, 5, 48))
    with pytest.raises(ValueError, match="m_splits: counts sum to 19 but inp has 20 rows"):
        layer(x, [6, 0, 13])
    with pytest.raises(ValueError, match=r"inp: expected shape .*got \(32,\)"):
        layer(torch.randn(32), [1, 0, 0])
    with pytest.raises(ValueError, match=r"inp\[0\]: expected shape"):   # lists stay 2-D
        layer([torch.randn(1, 2, 32), torch.randn(0, 32), torch.randn(0, 32)])


@pytest.mark.parametrize("list_mode", [False, True])
@pytest.mark.parametrize("recipe", ["none", "current", "delayed"])
def test_transposed_inputs_give_the_contiguous_results(recipe, list_mode):
    """A view with a non-unit column stride (``x.t()``) reaches the FP8 cast as a copy: the same
    bits and gradients as the contiguous input. Without FP8 torch's matmul takes the view as it
    is (its BLAS may sum in another order): equal within float32 rounding."""
    sp = [7, 0, 13]
    want = run(make_layer(3), torch.randn(20, 32, generator=torch.Generator().manual_seed(1)),
               sp, RECIPES[recipe], list_mode)
    layer = make_layer(3)
    xt = torch.randn(20, 32, generator=torch.Generator().manual_seed(1)).t().contiguous()
    xt.requires_grad_()
    x = xt.t()                                             # (20, 32), strides (1, 20)
    inp = list(x.split(sp)) if list_mode else x
    with _autocast(RECIPES[recipe]):
        y = layer(inp, None if list_mode else sp)
    yc = torch.cat(y) if list_mode else y
    yc.backward(torch.ones_like(yc))
    got = (yc.detach(), xt.grad.t(), [w.grad for w in layer.weights()],
           [b.grad for b in layer.biases()])
    if recipe == "none":
        torch.testing.assert_close(got, want)
    else:
        assert_bits_equal(got, want, recipe)
    if recipe == "delayed":      # calibration records the same amaxes from the copy
        layers = [make_layer(3), make_layer(3)]
        for lay, xi in zip(layers, (x.detach(), x.detach().contiguous())):
            with fp8_autocast(enabled=False, fp8_recipe=RECIPES["delayed"], calibrating=True):
                lay(list(xi.split(sp)) if list_mode else xi, None if list_mode else sp)
        assert_bits_equal(layers[0].fp8_amax_history, layers[1].fp8_amax_history)


@pytest.mark.parametrize("splits", [
    [np.int64(7), np.int32(0), np.uint16(13)], (7, np.intp(0), 13), np.array([7, 0, 13]),
    np.array([7, 0, 13], dtype=np.uint8), torch.tensor([7, 0, 13], dtype=torch.int32),
])
def test_m_splits_accepts_numpy_and_any_integral(splits):
    layer = make_layer(3)
    x = torch.randn(20, 32)
    want = layer(x, [7, 0, 13])
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        want8 = layer(x, [7, 0, 13])
        assert torch.equal(layer(x, splits), want8)
    assert torch.equal(layer(x, splits), want)
    assert layer._host_splits(splits) == [7, 0, 13]
    assert all(type(v) is int for v in layer._host_splits(splits))


@pytest.mark.parametrize("splits, exc, match", [
    ([True, 0, 19], TypeError, "m_splits: expected ints, got True"),
    ([np.bool_(True), 0, 19], TypeError, "m_splits: expected ints"),
    ([np.float32(7), 0, 13], TypeError, "m_splits: expected ints"),
    (np.array([7.0, 0, 13]), TypeError, "m_splits: expected a 1-D integer array"),
    (np.array([[7, 0, 13]]), TypeError, "m_splits: expected a 1-D integer array"),
    ([np.int64(27), np.int64(-7), 0], ValueError, "m_splits: counts must be non-negative"),
])
def test_m_splits_rejects_non_integers_naming_the_argument(splits, exc, match):
    with pytest.raises(exc, match=match):
        make_layer(3)(torch.randn(20, 32), splits)


@pytest.mark.parametrize("list_mode", [False, True])
def test_torch_autocast_without_fp8_computes_in_the_autocast_dtype(list_mode):
    """fp32 params under ``torch.autocast("cpu", bfloat16)``: TransformerEngine casts inputs,
    weights and biases to bf16; the result equals a bf16 copy of the layer bit for bit, and the
    grads reach the fp32 params (as the bf16 grads, upcast)."""
    sp = [6, 0, 11]
    layer = make_layer(3)
    bf16 = copy.deepcopy(layer).bfloat16()
    x, dy = torch.randn(17, 32), torch.randn(17, 48).bfloat16()
    want = run(bf16, x.bfloat16(), sp, None, list_mode, dy)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        inp = [t.clone().requires_grad_() for t in x.split(sp)] if list_mode else x.clone().requires_grad_()
        y = layer(inp, None if list_mode else sp)
    y = torch.cat(y) if list_mode else y
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    dx = torch.cat([t.grad for t in inp]) if list_mode else inp.grad
    assert dx.dtype == torch.float32 and layer.weight0.grad.dtype == layer.bias0.grad.dtype == torch.float32
    assert_bits_equal(y.detach(), want[0])
    assert_bits_equal(dx, want[1].float())
    assert_bits_equal([w.grad for w in layer.weights()], [g.float() for g in want[2]])
    assert_bits_equal([b.grad for b in layer.biases()], [g.float() for g in want[3]])


def test_torch_autocast_fused_wgrad_acts_on_the_parameters():
    """fuse_wgrad_accumulation under torch.autocast without FP8: overwrite_main_grad and
    Megatron's grad_added_to_main_grad act on the fp32 parameters themselves (the autograd
    function casts the weights; the module does not hand it copies), and main_grad holds the
    bf16 layer's gradient in fp32."""
    sp = [6, 0, 11]
    layer = make_layer(3, fuse_wgrad_accumulation=True)
    bf16 = make_layer(3).bfloat16()             # the same weights (same seed), unfused
    seen = []
    for w in layer.weights():
        w.main_grad = torch.full_like(w, 1000.0)
        w.overwrite_main_grad, w.grad_added_to_main_grad = True, False
        w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    x, dy = torch.randn(17, 32), torch.randn(17, 48).bfloat16()
    want = run(bf16, x.bfloat16(), sp, None, False, dy)[2]
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        y = layer(x, sp)
    y.backward(dy)
    assert seen == [True] * 3
    for w, g in zip(layer.weights(), want):
        assert w.grad_added_to_main_grad and w.grad.dtype == torch.float32
        torch.testing.assert_close(w.main_grad, g.float(), rtol=1e-2, atol=1e-2)   # overwritten


@pytest.mark.parametrize("how", ["float64", "transposed_view"])
def test_fused_wgrad_takes_any_float_dtype_and_strided_inputs(how):
    """The non-FP8 fused wgrad falls back to torch's matmul for float64 (gradcheck's dtype) and
    makes non-row-major input views contiguous, like the unfused layer."""
    sp = [6, 0, 11]
    dtype = torch.float64 if how == "float64" else torch.float32
    plain = make_layer(3, dtype=dtype)
    fused = make_layer(3, dtype=dtype, fuse_wgrad_accumulation=True)
    for w in fused.weights():
        w.main_grad = torch.zeros(w.shape)
    x = torch.randn(17, 32, dtype=dtype)
    if how == "transposed_view":
        x = x.t().contiguous().t()          # same values, column-major storage
    want = run(plain, x, sp, None, True)[2]
    run(fused, x, sp, None, True)
    for w, g in zip(fused.weights(), want):
        torch.testing.assert_close(w.main_grad, g.float(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_torch_autocast_with_fp8_quantizes_bf16_inputs_and_fp32_weights(recipe):
    """Under autocast with FP8 the inputs are cast to bf16 before quantization and the weights are
    quantized from fp32: on bf16-representable inputs and grads that is the same FP8 data as the
    fp32 run, so dW (fp32) is bit-identical and y, dx are the fp32 run's values rounded to bf16."""
    sp = [6, 0, 11]
    rec = RECIPES[recipe]
    ref, layer = make_layer(3, bias=False), make_layer(3, bias=False)
    x = torch.randn(17, 32).bfloat16().float()
    dy = torch.randn(17, 48).bfloat16()
    want = run(ref, x, sp, rec, False, dy.float())
    inp = x.clone().requires_grad_()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16), fp8_autocast(fp8_recipe=rec):
        y = layer(inp, sp)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    assert_bits_equal(y.detach(), want[0].bfloat16())
    assert_bits_equal(inp.grad, want[1].bfloat16().float())
    assert_bits_equal([w.grad for w in layer.weights()], want[2])
    if rec.delayed():
        assert_bits_equal(layer.fp8_scale, ref.fp8_scale)


def test_torch_autocast_with_fp8_bias_and_return_bias():
    sp = [6, 0, 11]
    layer = make_layer(3)
    x = torch.randn(17, 32, requires_grad=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16), \
            fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = layer(x, sp)
        y2, biases = make_layer(3, return_bias=True)(x, sp)
    assert y.dtype == y2.dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in biases)
    y.float().sum().backward()
    for i, m in enumerate(sp):
        assert layer.biases()[i].grad.dtype == torch.float32
        torch.testing.assert_close(layer.biases()[i].grad, torch.full((48,), float(m)))
    ref = torch.cat([xi.double() @ w.double().T + b.double() for xi, w, b in
                     zip(x.detach().split(sp), layer.weights(), layer.biases())])
    assert (y.double() - ref).norm() / ref.norm() < 0.1
    # fused bias (added before the bf16 rounding) vs added after it: one bf16 rounding apart
    torch.testing.assert_close(torch.cat([p + b for p, b in zip(y2.split(sp), biases)]), y,
                               rtol=1e-2, atol=1e-2)


def test_dtype_mismatch_outside_autocast_still_raises():
    layer = make_layer(3)
    with pytest.raises(TypeError, match="inp: dtype torch.bfloat16 differs"):
        layer(torch.randn(4, 32).bfloat16(), [4, 0, 0])
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="inp: expected a floating-point dtype"):
            layer(torch.ones(4, 32, dtype=torch.int32), [4, 0, 0])


@pytest.mark.parametrize("recipe", ["none", "current"])
def test_torch_compile_fullgraph_with_return_bias_3d_input_and_autocast(recipe):
    torch._dynamo.reset()
    eager = make_layer(3, return_bias=True)
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    x = torch.randn(2, 10, 32)
    outs = []
    for fn, mod in ((eager, eager), (compiled, compiled_layer)):
        inp = x.clone().requires_grad_()
        with _autocast(RECIPES[recipe]), torch.autocast("cpu", torch.bfloat16):
            y, biases = fn(inp, [4, 0, 16])
        y.float().sum().backward()
        outs.append((y.detach(), inp.grad, [w.grad for w in mod.weights()], list(biases)))
    assert outs[0][0].shape == (2, 10, 48) and outs[0][0].dtype == torch.bfloat16
    assert_bits_equal(outs[1][:3], outs[0][:3], recipe)
    assert_bits_equal([b.detach() for b in outs[1][3]], [b.detach() for b in outs[0][3]])


@pytest.mark.parametrize("new_len", [2, 5, 9])
def test_changing_amax_history_len_keeps_the_fp8_state(new_len):
    """TransformerEngine's ``adjust_amax_history_length``: the history is cut to its newest
    entries (column 0 is the newest) or zero-padded; amax, scale and scale_inv are kept."""
    x = torch.randn(30, 32)
    layer = make_layer(3)
    run(layer, x, [10, 5, 15], DelayedScaling(amax_history_len=5), False, steps=3)
    before = {n: getattr(layer, n).clone() for n in
              ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv")}
    assert torch.all(before["fp8_scale"] != 1)
    rec = DelayedScaling(amax_history_len=new_len)
    layer.init_fp8_state(rec)
    hist = layer.fp8_amax_history
    assert hist.shape == (9, new_len) and layer._fp8_recipe == rec
    keep = min(new_len, 5)
    assert_bits_equal(hist[:, :keep], before["fp8_amax_history"][:, :keep])
    assert torch.count_nonzero(hist[:, keep:]) == 0
    for n in ("fp8_amax", "fp8_scale", "fp8_scale_inv"):
        assert_bits_equal(getattr(layer, n), before[n], n)
    # a training step under the new recipe does the same, then rolls the kept history by one
    fwd = make_layer(3)
    run(fwd, x, [10, 5, 15], DelayedScaling(amax_history_len=5), False, steps=3)
    resized = torch.nn.functional.pad(before["fp8_amax_history"], (0, max(0, new_len - 5)))
    run(fwd, x, [10, 5, 15], rec, False)
    assert fwd.fp8_amax_history.shape == (9, new_len)
    assert_bits_equal(fwd.fp8_amax_history[:, 1:], resized[:, :new_len - 1])
    assert torch.isfinite(fwd.fp8_scale).all() and torch.all(fwd.fp8_scale != 1)


@pytest.mark.parametrize("change", [dict(fp8_format=Format.E4M3), dict(margin=2)])
def test_changing_format_or_margin_starts_a_fresh_fp8_state(change):
    layer = make_layer(3)
    run(layer, torch.randn(30, 32), [10, 5, 15], DelayedScaling(amax_history_len=4), False)
    layer.init_fp8_state(DelayedScaling(amax_history_len=4, **change))
    assert torch.count_nonzero(layer.fp8_amax_history) == 0
    assert torch.all(layer.fp8_scale == 1)
