"""GroupedLinear's TransformerEngine options that move weight-gradient work out of the backward
pass: ``delay_wgrad_compute`` (wgrad queued for ``backward_dw()``) and ``save_original_input``
(the input saved, its transposed FP8 copy cast in backward). On the CPU path (casts on the
emulator, GEMMs on the NumPy reference): every result is compared bit for bit with the same
layer without the option, which the other test files check against independent references."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from cugrouped.pytorch import DelayedScaling, Float8CurrentScaling, Format, GroupedLinear, fp8_autocast
from cugrouped.pytorch.moe import MoEFeedForward

RECIPES = {"none": None, "delayed": DelayedScaling(amax_history_len=8),
           "current": Float8CurrentScaling(),
           "delayed_e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1,
                                          amax_compute_algo="most_recent")}
SPLITS = [6, 0, 11]


def make_layer(E=3, k=32, n=48, **kw):
    torch.manual_seed(0)
    layer = GroupedLinear(E, k, n, bias=True, device="cpu", **kw)
    with torch.no_grad():
        for b in layer.biases():
            b.normal_()
    return layer


def same(a, b, label=""):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), label
        for i, (u, v) in enumerate(zip(a, b)):
            same(u, v, f"{label}[{i}]")
        return
    assert (a is None) == (b is None), label
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), label


def step(layer, x, dy, recipe, list_mode, **fw):
    """One forward + backward; returns (output, input grad, bias grads) of this step."""
    inp = [t.detach().clone().requires_grad_() for t in x.split(SPLITS)] if list_mode \
        else x.detach().clone().requires_grad_()
    for b in layer.biases():
        b.grad = None
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = layer(inp, None if list_mode else SPLITS, **fw)
    y = torch.cat(y) if list_mode else y
    y.backward(dy)
    dx = torch.cat([t.grad for t in inp]) if list_mode else inp.grad
    return y.detach(), dx, [b.grad.clone() for b in layer.biases()]


def data(steps=2):
    torch.manual_seed(1)
    return [(torch.randn(sum(SPLITS), 32), torch.randn(sum(SPLITS), 48)) for _ in range(steps)]


@pytest.mark.parametrize("order", ["after_each", "after_all"])
@pytest.mark.parametrize("list_mode", [False, True])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_delayed_wgrad_equals_immediate(recipe, list_mode, order):
    """Two micro-batches. Backward gives the same outputs, input and bias gradients and leaves
    the weight gradients alone; backward_dw() (after each backward, or both after the last: a
    queue, oldest first) then gives the weight gradients bit for bit, accumulated as autograd
    does. Delayed scaling: the scale update of the first backward changes the second step's
    scales, and each queued wgrad keeps its own step's."""
    rec = RECIPES[recipe]
    plain, lazy = make_layer(), make_layer(delay_wgrad_compute=True)
    assert lazy.need_backward_dw() and not plain.need_backward_dw()
    for x, dy in data():
        same(step(lazy, x, dy, rec, list_mode), step(plain, x, dy, rec, list_mode), "step")
        if order == "after_each":
            lazy.backward_dw()
        else:
            assert all(w.grad is None for w in lazy.weights())
    while len(lazy.wgrad_store):
        lazy.backward_dw()
    same([w.grad for w in lazy.weights()], [w.grad for w in plain.weights()], "wgrad")
    if rec is not None and isinstance(rec, DelayedScaling):
        same(lazy.fp8_scale, plain.fp8_scale, "scale")
    lazy.backward_dw()              # nothing pending: a no-op
    same([w.grad for w in lazy.weights()], [w.grad for w in plain.weights()], "wgrad")


@pytest.mark.parametrize("recipe", ["none", "current", "delayed"])
def test_delayed_wgrad_into_main_grad_with_megatron_hooks(recipe):
    """fuse_wgrad_accumulation + delay_wgrad_compute, as Megatron runs them: every parameter is
    marked skip_backward_post_hook (its DDP then registers its grad-ready hooks on the module);
    backward sets grad_added_to_main_grad with a dummy grad and does not touch main_grad; each
    backward_dw() writes main_grad (overwriting on the first micro-batch, as decided in its
    forward) and then runs the hooks."""
    rec = RECIPES[recipe]
    plain = make_layer(fuse_wgrad_accumulation=True)
    lazy = make_layer(fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    assert all(p.skip_backward_post_hook for p in lazy.parameters())
    assert not any(hasattr(p, "skip_backward_post_hook") for p in plain.parameters())
    calls = []
    lazy.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(
        [w.main_grad.clone() for w in lazy.weights()]))
    with pytest.raises(TypeError, match="hook: expected a callable"):
        lazy.register_wgrad_accumulation_and_reduce_hooks(3)
    for layer in (plain, lazy):
        for w in layer.weights():
            w.main_grad = torch.full_like(w, 7.0)
            w.grad_added_to_main_grad = False
    for i, (x, dy) in enumerate(data()):
        first = i == 0
        step(plain, x, dy, rec, False, is_first_microbatch=first)
        step(lazy, x, dy, rec, False, is_first_microbatch=first)
        assert all(w.grad_added_to_main_grad and w.grad.shape == w.shape for w in lazy.weights())
        if first:
            assert all(torch.equal(w.main_grad, torch.full_like(w, 7.0)) for w in lazy.weights())
    assert calls == []
    lazy.backward_dw()
    lazy.backward_dw()
    assert len(calls) == 2
    same(calls[1], [w.main_grad for w in plain.weights()], "main_grad")
    lazy.backward_dw()
    assert len(calls) == 2          # nothing pending: no hooks either (TransformerEngine)


def test_zero_out_wgrad_makes_the_dummy_grad_zeros():
    """Megatron adds the dummy grad of a weight marked zero_out_wgrad into main_grad: zeros."""
    layer = make_layer(fuse_wgrad_accumulation=True)
    for w in layer.weights():
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad, w.zero_out_wgrad = False, True
    x, dy = data(1)[0]
    step(layer, x, dy, None, False)
    assert all(torch.equal(w.grad, torch.zeros_like(w)) for w in layer.weights())


def test_delay_wgrad_compute_refused_under_torch_compile():
    torch._dynamo.reset()
    layer = make_layer(delay_wgrad_compute=True)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="delay_wgrad_compute: not under torch.compile"):
        compiled(torch.randn(sum(SPLITS), 32), SPLITS)


def _saved_bytes(layer, x, dy, recipe, **fw):
    """Run a step; return the uint8 bytes and the ids of the tensors autograd saved for it."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(layer, x, dy, recipe, False, **fw)
    return out, sum(t.numel() for t in saved if t.dtype == torch.uint8), saved


@pytest.mark.parametrize("qparams", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_save_original_input_same_bits_without_the_fp8_copy(delay, qparams):
    """Current scaling: backward casts the saved input again, with the same amax, scale and bits
    as the forward's cast, so everything equals the default layer; only the weights' transposed
    FP8 copy is saved as bytes (not the input's). Without FP8 nothing changes. ``qparams``: the
    input's amax_epsilon / power_2_scale apply to the second cast too."""
    rec = RECIPES["current"]
    if qparams:
        from cugrouped.pytorch import QParams

        rec = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(amax_epsilon=50.0))
    E, k, n = 3, 32, 48
    plain = make_layer()
    lean = make_layer(save_original_input=True, delay_wgrad_compute=delay)
    for x, dy in data():
        a, bytes_a, _ = _saved_bytes(plain, x, dy, rec)
        b, bytes_b, saved_b = _saved_bytes(lean, x, dy, rec)
        same(b, a, "step")
        assert bytes_b == E * n * k                                     # W^T only
        assert bytes_a == E * n * k + k * sum(-(-m // 16) * 16 for m in SPLITS)
        assert any(t.dtype == torch.float32 and t.shape == x.shape for t in saved_b)
        lean.backward_dw()
        same([w.grad for w in lean.weights()], [w.grad for w in plain.weights()], "wgrad")
        for layer in (plain, lean):
            for w in layer.weights():
                w.grad = None
    x, dy = data(1)[0]
    same(step(lean, x, dy, None, True), step(plain, x, dy, None, True), "no fp8")


def test_save_original_input_refused_with_delayed_scaling():
    layer = make_layer(save_original_input=True)
    x, dy = data(1)[0]
    with pytest.raises(ValueError, match="save_original_input: not with DelayedScaling"):
        step(layer, x, dy, RECIPES["delayed"], False)


@pytest.mark.parametrize("recipe", ["none", "current"])
def test_moe_block_backward_dw(recipe):
    """MoEFeedForward(delay_wgrad_compute=True): the router's and the input's gradients come out
    of backward; fc1's and fc2's weight gradients out of backward_dw(), equal to the default
    block's."""
    rec = RECIPES[recipe]
    torch.manual_seed(0)
    plain = MoEFeedForward(32, 32, 4, 2, device="cpu")
    lazy = MoEFeedForward(32, 32, 4, 2, device="cpu", delay_wgrad_compute=True)
    lazy.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, 32)
    grads = []
    for block in (plain, lazy):
        xi = x.clone().requires_grad_()
        with fp8_autocast(enabled=rec is not None, fp8_recipe=rec):
            block(xi).square().sum().backward()
        grads.append(xi.grad)
    same(grads[1], grads[0], "dx")
    same(lazy.router.weight.grad, plain.router.weight.grad, "router")
    assert all(w.grad is None for w in (*lazy.fc1.weights(), *lazy.fc2.weights()))
    lazy.backward_dw()
    for name, p in plain.named_parameters():
        same(dict(lazy.named_parameters())[name].grad, p.grad, name)
    assert copy.deepcopy(lazy).fc1.need_backward_dw()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_gpu_deferred_wgrad_equals_immediate(recipe):
    """On CUDA (cuBLASLt wgrad, queued closures holding device tensors): the same bits as the
    default layer; save_original_input too with current scaling."""
    rec = RECIPES[recipe]
    kw = dict(save_original_input=True) if recipe == "current" else {}
    plain = make_layer().cuda().bfloat16()
    lazy = make_layer(delay_wgrad_compute=True, **kw).cuda().bfloat16()
    for x, dy in data():
        x, dy = x.cuda().bfloat16(), dy.cuda().bfloat16()
        same(step(lazy, x, dy, rec, True), step(plain, x, dy, rec, True), "step")
    lazy.backward_dw()
    lazy.backward_dw()
    same([w.grad for w in lazy.weights()], [w.grad for w in plain.weights()], "wgrad")


# ---------------------------------------------------------------------------------------------
# Edge cases found in review

@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
@pytest.mark.parametrize("kw", [dict(delay_wgrad_compute=True), dict(fuse_wgrad_accumulation=True)],
                         ids=["deferred", "main_grad"])
def test_backward_without_the_weights_computes_no_wgrad(kw, how):
    """A backward asked for the input gradient only: autograd drops a returned weight gradient,
    but main_grad written or a wgrad queued would stay; neither happens (the weights'
    AccumulateGrad nodes are not executed). The input gradient is unchanged."""
    layer, plain = make_layer(**kw), make_layer()
    for w in layer.weights():
        w.main_grad = torch.zeros_like(w)
    x, dy = data(1)[0]
    grads = []
    for lay in (layer, plain):
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPES["current"]):
            y = lay(xi, SPLITS)
        if how == "autograd.grad":
            grads.append(torch.autograd.grad(y, xi, dy)[0])
        else:
            y.backward(dy, inputs=[xi])
            grads.append(xi.grad)
    same(grads[0], grads[1], "dx")
    assert all(w.grad is None and not w.main_grad.any() for w in layer.weights())
    if layer.delay_wgrad_compute:
        assert not layer.wgrad_store
    step(layer, x, dy, RECIPES["current"], False)      # a full backward still does the wgrad
    layer.backward_dw()
    assert all(w.main_grad.any() if layer.fuse_wgrad_accumulation else w.grad is not None
               for w in layer.weights()[::2])


@pytest.mark.parametrize("recipe", ["none", "current"])
@pytest.mark.parametrize("delay", [False, True])
def test_frozen_first_expert(recipe, delay):
    """Weights that do not all require grad (expert 0 frozen): the others get their gradients
    (deferred or not), the frozen one none."""
    rec = RECIPES[recipe]
    plain, layer = make_layer(), make_layer(delay_wgrad_compute=delay)
    for lay in (plain, layer):
        lay.weight0.requires_grad_(False)
    x, dy = data(1)[0]
    same(step(layer, x, dy, rec, False), step(plain, x, dy, rec, False))
    layer.backward_dw()
    assert layer.weight0.grad is None
    same([w.grad for w in layer.weights()], [w.grad for w in plain.weights()])


def test_backward_dw_gives_plain_tensors_and_follows_the_meta_flow():
    """backward_dw() runs without autograd (its grads have no grad_fn, as autograd's), the
    option can be switched on after construction, and the meta-device flow
    (to_empty + reset_parameters) keeps the skip_backward_post_hook marks."""
    layer = make_layer()
    layer.delay_wgrad_compute = True
    x, dy = data(1)[0]
    step(layer, x, dy, None, False)
    assert all(w.grad is None for w in layer.weights())
    layer.backward_dw()
    assert all(w.grad is not None and w.grad.grad_fn is None and not w.grad.requires_grad
               for w in layer.weights()[::2])
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):   # after use
        same([w for w in copied.weights()], [w for w in layer.weights()])
    meta = GroupedLinear(3, 32, 48, device="meta", delay_wgrad_compute=True)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert all(getattr(p, "skip_backward_post_hook", False) for p in meta.parameters())


@pytest.mark.parametrize("kw", [dict(delay_wgrad_compute=True), dict(fuse_wgrad_accumulation=True)],
                         ids=["deferred", "main_grad"])
def test_wgrad_only_for_the_weights_autograd_asks_for(kw):
    """backward(inputs=[weight0]) and autograd.grad(y, [weight0, x]): expert 0's weight gradient
    only (main_grad written or grad set for it alone), no error; the input gradient unchanged."""
    x, dy = data(1)[0]
    for how in ("inputs", "autograd.grad"):
        layer, plain = make_layer(**kw), make_layer()
        for w in layer.weights():
            w.main_grad = torch.zeros_like(w)
        xi = x.clone().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPES["current"]):
            y = layer(xi, SPLITS)
        if how == "inputs":
            y.backward(dy, inputs=[layer.weight0])
        else:
            dx = torch.autograd.grad(y, [layer.weight0, xi], dy, allow_unused=True)[1]
            with fp8_autocast(fp8_recipe=RECIPES["current"]):
                want = torch.autograd.grad(plain(xi, SPLITS), xi, dy)[0]
            same(dx, want, "dx")
        layer.backward_dw()
        got = [w.main_grad.any().item() if layer.fuse_wgrad_accumulation else w.grad is not None
               for w in layer.weights()]
        assert got == [True, False, False], (how, got)


@pytest.mark.parametrize("delay", [False, True])
def test_frozen_expert_needs_no_main_grad(delay):
    """Megatron gives main_grad to trainable parameters only: a frozen expert has none and gets
    nothing written; the others get theirs, as the plain layer's gradients."""
    plain = make_layer()
    layer = make_layer(fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    for lay in (plain, layer):
        lay.weight1.requires_grad_(False)
    for w in (layer.weight0, layer.weight2):
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    layer.weight1.grad_added_to_main_grad = False
    x, dy = data(1)[0]
    step(layer, x, dy, RECIPES["current"], False)
    step(plain, x, dy, RECIPES["current"], False)
    layer.backward_dw()
    assert not hasattr(layer.weight1, "main_grad") and layer.weight1.grad is None
    assert layer.weight1.grad_added_to_main_grad is False
    for i in (0, 2):
        w = layer.weights()[i]
        torch.testing.assert_close(w.main_grad, plain.weights()[i].grad, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(delay_wgrad_compute=True), dict(fuse_wgrad_accumulation=True)],
                         ids=["deferred", "main_grad"])
def test_parameters_cast_after_a_forward_still_get_gradients(kw):
    """.double() after a forward gives the parameters new gradient accumulators: the layer's
    cached ones must not make backward skip the wgrad."""
    layer = make_layer(**kw)
    x, dy = data(1)[0]
    for w in layer.weights():
        w.main_grad = torch.zeros_like(w)
    step(layer, x, dy, None, False)
    layer.backward_dw()
    layer.double()
    for w in layer.weights():
        w.main_grad, w.grad = torch.zeros_like(w, dtype=torch.float32), None
    step(layer, x.double(), dy.double(), None, False)
    layer.backward_dw()
    w = layer.weight0
    assert (w.main_grad if layer.fuse_wgrad_accumulation else w.grad).abs().sum() > 0
