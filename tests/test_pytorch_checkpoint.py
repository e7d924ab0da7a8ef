"""cugrouped.pytorch.checkpoint: activation recomputation of FP8 GroupedLinear / MoE code, compared
bit for bit with the same code run without checkpointing (CPU path: casts on the emulator, GEMMs on
the NumPy reference; the last test on a GPU)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from cugrouped.pytorch import (DelayedScaling, Float8CurrentScaling, Format, GroupedLinear,
                               MoEFeedForward, checkpoint, fp8_autocast)

RECIPES = {"none": None, "current": Float8CurrentScaling(),
           "delayed": DelayedScaling(amax_history_len=4),
           "delayed_e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1,
                                          amax_compute_algo="most_recent")}
SPLITS = [6, 0, 11]


def layer_pair(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    a = GroupedLinear(3, 32, 48, bias=True, device="cpu").to(device, dtype)
    with torch.no_grad():
        for b in a.biases():
            b.normal_()
    return a, copy.deepcopy(a)


def same(a, b, label=""):
    if isinstance(a, (list, tuple)):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            same(u, v, f"{label}[{i}]")
        return
    assert (a is None) == (b is None), label
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), label


def pipeline(layer, recipe, batches, ckpt, list_mode=False, cache=True):
    """Steps of two micro-batches in pipeline order (forward 1, forward 2, backward 1,
    backward 2): the first backward updates the delayed scales before the second micro-batch is
    recomputed. Returns every output and input grad, and the final parameter grads."""
    outs = []
    for step in batches:
        pending = []
        for i, (x, dy) in enumerate(step):
            inp = [t.clone().requires_grad_() for t in x.split(SPLITS)] if list_mode \
                else x.clone().requires_grad_()
            args = (inp, None if list_mode else SPLITS)
            kw = dict(is_first_microbatch=i == 0) if cache else {}
            with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = checkpoint(layer, *args, **kw) if ckpt else layer(*args, **kw)
            pending.append((inp, torch.cat(y) if list_mode else y, dy))
        for inp, y, dy in pending:
            y.backward(dy)
            outs += [y.detach(), torch.cat([t.grad for t in inp]) if list_mode else inp.grad]
    return outs, [p.grad for p in layer.parameters()]


def batches(device="cpu", dtype=torch.float32, steps=2):
    torch.manual_seed(1)
    return [[(torch.randn(sum(SPLITS), 32, device=device, dtype=dtype) * (1 + 3 * s),
              torch.randn(sum(SPLITS), 48, device=device, dtype=dtype)) for _ in range(2)]
            for s in range(steps)]


@pytest.mark.parametrize("cache", [True, False], ids=["weight_cache", "no_cache"])
@pytest.mark.parametrize("list_mode", [False, True])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_checkpointed_layer_equals_plain(recipe, list_mode, cache):
    """Also the delayed-scaling state: a recomputation that merged its amaxes again would put
    the second micro-batch's input and weight amaxes into the next window a second time."""
    plain, ckpt = layer_pair()
    data = batches()
    want = pipeline(plain, RECIPES[recipe], data, False, list_mode, cache)
    got = pipeline(ckpt, RECIPES[recipe], data, True, list_mode, cache)
    same(got, want)
    if recipe.startswith("delayed"):
        for name in ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
            same(getattr(ckpt, name), getattr(plain, name), name)


def test_checkpointed_moe_block_equals_plain():
    """The whole expert block recomputed (router, both GroupedLinears, activation), two layers
    in one checkpoint, delayed scaling, and a backward through the retained graph twice."""
    rec = RECIPES["delayed"]
    torch.manual_seed(0)
    plain = MoEFeedForward(32, 32, 4, 2, device="cpu", bias=True)
    ckpt = copy.deepcopy(plain)
    torch.manual_seed(2)
    xs = [torch.randn(2, 7, 32) for _ in range(2)]
    results = []
    for block, use in ((plain, False), (ckpt, True)):
        grads = []
        for x in xs:
            x = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=rec):
                y = checkpoint(block, x) if use else block(x)
            for _ in range(2):
                y.square().sum().backward(retain_graph=True)
            grads.append(x.grad)
        results.append((grads, [p.grad for p in block.parameters()], block.fc1.fp8_scale.clone()))
    same(results[1], results[0])


def test_recomputation_leaves_the_scaling_state_alone():
    """Only the original forward merges its amaxes into the pending amax: after a checkpointed
    forward the state is what the plain forward leaves; the recomputation in backward adds
    nothing beyond what the plain backward does."""
    plain, ckpt = layer_pair()
    rec = RECIPES["delayed"]
    x = torch.randn(sum(SPLITS), 32).requires_grad_()
    with fp8_autocast(fp8_recipe=rec):
        ya, yb = plain(x, SPLITS), checkpoint(ckpt, x, SPLITS)
    same(ckpt.fp8_amax, plain.fp8_amax, "amax after forward")
    ya.sum().backward()
    yb.sum().backward()
    for name in ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
        same(getattr(ckpt, name), getattr(plain, name), name)


class Tracker:
    """Megatron-LM's RNG states tracker protocol (``get_states``, ``set_states``, ``fork``) on
    the CPU generator."""

    def __init__(self):
        self.states = {"model-parallel-rng": torch.Generator().manual_seed(5).get_state()}

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = dict(states)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_rng_state_tracker_replays_dropout(recipe):
    """Dropout inside the tracker's fork (Megatron's expert-parallel RNG): the recomputation
    draws the forward's masks, and the tracker continues afterwards as without checkpointing.
    Without the tracker the recomputation draws other masks (so the test can fail)."""
    rec = RECIPES[recipe]
    results = []
    for how in ("plain", "tracked", "untracked"):
        layer = layer_pair()[0]
        tracker = Tracker()

        def f(x):
            h = layer(x, SPLITS)
            with tracker.fork():
                return torch.nn.functional.dropout(h, 0.5)

        grads = []
        for x, dy in batches()[0]:
            x = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=rec):
                if how == "plain":
                    y = f(x)
                else:
                    y = checkpoint(f, x, distribute_saved_activations=False, tp_group=None,
                                   get_rng_state_tracker=(lambda: tracker) if how == "tracked"
                                   else None)
            y.backward(dy)
            grads += [x.grad, layer.weight0.grad.clone()]
        results.append((grads, tracker.states["model-parallel-rng"]))
    same(results[1], results[0])
    assert not torch.equal(results[2][0][0], results[0][0][0])


def test_calibration_is_not_recorded_twice():
    """Calibrating (FP8 off, calibrating=True) under checkpoint: the recomputation does not
    record the amaxes and roll the history a second time."""
    plain, ckpt = layer_pair()
    rec = RECIPES["delayed"]
    for layer, use in ((plain, False), (ckpt, True)):
        for x, dy in batches(steps=1)[0]:
            x = x.clone().requires_grad_()
            with fp8_autocast(enabled=False, fp8_recipe=rec, calibrating=True):
                y = checkpoint(layer, x, SPLITS) if use else layer(x, SPLITS)
            y.backward(dy)
    for name in ("fp8_amax_history", "fp8_amax", "fp8_scale", "fp8_scale_inv"):
        same(getattr(ckpt, name), getattr(plain, name), name)
    same([p.grad for p in ckpt.parameters()], [p.grad for p in plain.parameters()])


def test_callers_context_fn_is_entered_too():
    """A context_fn of the caller's (TransformerEngine composes one) runs in the forward and in
    the recomputation, around ours; the gradients stay those of the plain run."""
    seen = []

    @contextlib.contextmanager
    def mark(name):
        seen.append(name)
        yield

    plain, ckpt = layer_pair()
    data = batches(steps=1)
    want = pipeline(plain, RECIPES["delayed"], data, False)
    class Run(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = ckpt

        def forward(self, inp, splits, **kw):
            return checkpoint(self.layer, inp, splits,
                              context_fn=lambda: (mark("fwd"), mark("re")), **kw)

    same(pipeline(Run(), RECIPES["delayed"], data, False), want)
    assert seen == ["fwd", "fwd", "re", "re"]


@pytest.mark.parametrize("kw, exc, match", [
    (dict(use_reentrant=True), ValueError, "use_reentrant: only the non-reentrant"),
    (dict(distribute_saved_activations=1), TypeError, "distribute_saved_activations"),
    (dict(get_rng_state_tracker=3), TypeError, "get_rng_state_tracker: expected None or a callable"),
    (dict(get_rng_state_tracker=lambda: None), TypeError, "get_rng_state_tracker: its tracker"),
])
def test_checkpoint_errors_name_the_argument(kw, exc, match):
    layer = layer_pair()[0]
    with pytest.raises(exc, match=match):
        checkpoint(layer, torch.randn(17, 32), SPLITS, **kw)
    with pytest.raises(TypeError, match="function: expected a callable"):
        checkpoint(3, torch.randn(2))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_gpu_checkpointed_layer_equals_plain(recipe):
    plain, ckpt = layer_pair("cuda", torch.bfloat16)
    data = batches("cuda", torch.bfloat16)
    same(pipeline(ckpt, RECIPES[recipe], data, True, True),
         pipeline(plain, RECIPES[recipe], data, False, True))
