"""TransformerEngine GroupedLinear checkpoints into cugrouped, delayed-scaling state included
(cugrouped/pytorch/te_checkpoint.py).

Two kinds of TE states: the files in tests/data/te_extra_state/ are byte for byte what TE
serializes, its recipe objects pickled from TE's own recipe module of each release (see
make_fixtures.py there), and their values say what they are; the synthetic states below are
pickled with a stand-in of TE's recipe module (TE is not installed here) and random values, to
check the conversion's meaning: the next scale updates after loading are, bit for bit, the ones
TransformerEngine's update kernel would compute (modelled in NumPy from
``transformer_engine/common/recipe/delayed_scaling.cu``, ``kernel_bulk``).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import sys
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from cugrouped.pytorch import (DelayedScaling, Format, GroupedLinear, fp8_autocast,
                               from_te_extra_state, from_te_state_dict)
from cugrouped.reference.scale_update import update_scales

DATA = Path(__file__).parent / "data" / "te_extra_state"
E = 4                       # the fixtures' experts
ROLES = (0, 1, 3)           # cugrouped's tensor order: inputs, weights, grad outputs (TE's roles)


def value(role, expert, row):
    """What make_fixtures.py stored for TE tensor ``role`` of ``expert`` (row: history row / 16,
    or 0.5 for the scale)."""
    return np.float32(100.0 * (role + 1) + expert + 1 + row)


def payload(name):
    raw = (DATA / name).read_bytes()
    return io.BytesIO(raw) if name.endswith(".pt") else \
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)


FIXTURES = [  # file, TE version, history length, recipe written
    ("te2.9_interleaved_hybrid.pkl", "2.9", 8,
     {"margin": 1, "fp8_format": "hybrid", "amax_history_len": 8, "amax_compute_algo": "max"}),
    ("te2.2_blocked_e4m3.pkl", "2.2.1", 4,
     {"margin": 0, "fp8_format": "e4m3", "amax_history_len": 4,
      "amax_compute_algo": "most_recent"}),
    ("te1.13_bytesio.pt", "1.13.0", 6,      # TE 1.x stores no recipe: TE's default
     {"margin": 0, "fp8_format": "hybrid", "amax_history_len": 6, "amax_compute_algo": "max"}),
]


@pytest.mark.parametrize("name,version,L,recipe", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_te_checkpoints_convert_value_for_value(name, version, L, recipe):
    st = from_te_extra_state(payload(name), te_version=version)
    assert st["recipe"] == recipe and st["num_experts"] == E
    hist, amax, scale, scale_inv = (st[k].numpy() for k in ("amax_history", "amax", "scale",
                                                             "scale_inv"))
    assert hist.shape == (3 * E, L) and amax.shape == scale.shape == scale_inv.shape == (3 * E,)
    assert all(st[k].dtype == torch.float32 for k in ("amax_history", "amax", "scale",
                                                       "scale_inv"))
    for t in range(3 * E):
        role, e = ROLES[t // E], t % E
        assert scale[t] == value(role, e, 0.5), (t, scale[t])
        assert scale_inv[t] == np.float32(1) / scale[t]
        assert amax[t] == value(role, e, 0.0)                         # TE's pending row 0
        # newest first: TE's rows L-1, L-2, ..., 1; the slot TE does not have stays 0
        assert list(hist[t]) == [value(role, e, (L - 1 - j) / 16) for j in range(L - 1)] + [0.0]


def test_a_converted_checkpoint_loads_into_grouped_linear_and_trains():
    """A whole TE state_dict (same parameter names) loads strictly; the layer then casts with
    TE's scales and keeps training them."""
    torch.manual_seed(0)
    te_sd = {**{f"weight{i}": torch.randn(48, 32) for i in range(E)},
             **{f"bias{i}": torch.randn(48) for i in range(E)},
             "_extra_state": payload("te2.9_interleaved_hybrid.pkl")}
    sd = from_te_state_dict(te_sd, te_version="2.9.0")
    assert all(sd[k] is te_sd[k] for k in te_sd if k != "_extra_state")
    layer = GroupedLinear(E, 32, 48, params_dtype=torch.float32, device="cpu")
    layer.load_state_dict(sd, strict=True)
    st = layer.fp8_state()
    assert st.recipe == DelayedScaling(margin=1, fp8_format=Format.HYBRID, amax_history_len=8)
    assert torch.equal(st.tensors["scale"], sd["_extra_state"]["scale"])
    assert torch.equal(layer.weight2, te_sd["weight2"])
    x = torch.randn(40, 32, requires_grad=True)
    with fp8_autocast(fp8_recipe=DelayedScaling(margin=1, amax_history_len=8)):
        layer(x, [10, 0, 25, 5]).sum().backward()
    conv, h = sd["_extra_state"], layer.fp8_state().tensors["amax_history"]
    # the step rolled every history but expert 1's grad output's (it got no tokens): the
    # forward casts max-merged into TE's pending amaxes, the grad-output casts wrote theirs
    rolled = torch.arange(3 * E) != 2 * E + 1
    assert torch.equal(h[rolled, 1:], conv["amax_history"][rolled, :-1])
    assert torch.equal(h[~rolled], conv["amax_history"][~rolled])
    assert (h[:2 * E, 0] >= conv["amax"][:2 * E]).all()


def test_only_grouped_linears_extra_states_are_converted():
    """Beside a weight0 (or a 3-D weight: one grouped weight), a GroupedLinear's: converted, or
    TE's "no FP8 state" when it has none; a converted one, and the extra state of TE's other
    modules (a Linear's, beside a 2-D weight; attention's), stay the objects they are."""
    empty = torch.empty(0, dtype=torch.uint8)
    te = payload("te2.9_interleaved_hybrid.pkl")
    once = from_te_state_dict({"_extra_state": te, "weight0": empty}, te_version="2.9")
    sd = {"a._extra_state": empty, "a.weight0": empty,
          "b._extra_state": once["_extra_state"], "b.weight0": empty,
          "c._extra_state": io.BytesIO(_torch_save(None)), "c.weight0": empty,
          "g._extra_state": te, "g.weight": torch.zeros(E, 2, 2),
          "lin._extra_state": te, "lin.weight": torch.zeros(2, 2), "attn._extra_state": te}
    out = from_te_state_dict(sd, te_version="2.9")
    assert out["a._extra_state"].numel() == 0 and out["b._extra_state"] is sd["b._extra_state"]
    assert out["c._extra_state"].numel() == 0 and out["b.weight0"] is empty
    assert torch.equal(out["g._extra_state"]["scale"], once["_extra_state"]["scale"])
    assert out["lin._extra_state"] is te and out["attn._extra_state"] is te


def test_te1_states_keep_the_format_they_recorded():
    """TE 1.x stores no recipe but records its format's maxima (fp8_max_fwd / fp8_max_bwd):
    an E4M3 run converts as E4M3; a recipe= of another format is refused."""
    state = torch.load(DATA / "te1.13_bytesio.pt", map_location="cpu", weights_only=True)
    state["extra_fp8_variables"].update(fp8_max_fwd=448.0, fp8_max_bwd=448.0)
    e4m3 = io.BytesIO(_torch_save(state))
    st = from_te_extra_state(e4m3, te_version="1.11")
    assert st["recipe"]["fp8_format"] == "e4m3"
    st = from_te_extra_state(e4m3, te_version="1.11",
                             recipe=DelayedScaling(fp8_format=Format.E4M3, margin=2))
    assert st["recipe"]["fp8_format"] == "e4m3" and st["recipe"]["margin"] == 2
    with pytest.raises(ValueError, match=r"recipe: fp8_format Format.HYBRID differs from the "
                                         r"Format.E4M3"):
        from_te_extra_state(e4m3, te_version="1.11", recipe=DelayedScaling())


# -- synthetic TE states, pickled with a stand-in of TE's recipe module ------------------------
@pytest.fixture
def te_recipe(monkeypatch):
    """A module named like TE's recipe module, with its classes' shapes (TE not installed)."""
    mod = types.ModuleType("transformer_engine.common.recipe")

    class _FormatHelper(NamedTuple):
        max_fwd: int
        max_bwd: int

    class Format(enum.Enum):
        E4M3 = _FormatHelper(448, 448)
        E5M2 = _FormatHelper(57344, 57344)
        HYBRID = _FormatHelper(448, 57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: object = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
    for name in ("transformer_engine", "transformer_engine.common", mod.__name__):
        monkeypatch.setitem(sys.modules, name, mod if name == mod.__name__ else
                            types.ModuleType(name))
    return mod


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def te_columns(E, interleaved):
    """TE's forward columns (input, weight) and backward column (grad output) of each expert,
    as TE's GroupedLinear indexes its fp8_meta (``_offsets``)."""
    if interleaved:
        return [(3 * e, 3 * e + 1, 2 * e) for e in range(E)]
    return [(e, E + e, e) for e in range(E)]


def te_update(hist, scale, fp8_max, margin, algo):
    """TE's ``kernel_bulk`` on one ``(L, T)`` history (row 0: this step's amax) and its scales,
    in place: roll by one where row 0 is not 0, then scale = fp8_max * 2^-margin / amax where the
    amax is finite and positive (else the previous scale; an infinite scale becomes FLT_MAX)."""
    L, T = hist.shape
    for t in range(T):
        last = hist[0, t]
        amax = np.float32(0)
        if last != 0:
            a = np.append(hist[1:, t], last).astype(np.float32)
            amax = np.float32(np.fmax.reduce(a, initial=np.float32(0)))
            hist[:, t] = np.append(np.float32(0), a[1:])
        if algo == "most_recent":
            amax = last
        s = scale[t]
        if np.isfinite(amax) and amax > 0:
            with np.errstate(over="ignore"):
                s = np.float32(np.float32(fp8_max[t] * np.float32(2.0 ** -margin)) / amax)
        scale[t] = np.finfo(np.float32).max if np.isinf(s) else s


@pytest.mark.parametrize("version", ["2.9", "2.2", "1.12"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fmt,margin", [("HYBRID", 0), ("E4M3", 2)])
def test_the_next_updates_after_loading_are_transformer_engines(te_recipe, version, algo, fmt,
                                                                  margin):
    """Random TE state (NaN in histories, pending amaxes some 0): after conversion, cugrouped's
    scale update (the reference twin of its kernel) gives TE's scales bit for bit, at the update
    that consumes the saved pending amaxes and at three training steps after it."""
    rng = np.random.default_rng(7)
    En, L = 5, 6
    interleaved = version == "2.9"
    hist_f = (2.0 ** rng.uniform(-6, 6, (L, 3 * En))).astype(np.float32)
    hist_b = (2.0 ** rng.uniform(-20, -4, (L, 2 * En))).astype(np.float32)
    hist_f[rng.random(hist_f.shape) < 0.1] = np.nan
    hist_f[0, rng.random(3 * En) < 0.4] = 0                      # pending amaxes: some 0
    hist_b[0, rng.random(2 * En) < 0.4] = 0
    scale_f = (2.0 ** rng.uniform(-3, 3, 3 * En)).astype(np.float32)
    scale_b = (2.0 ** rng.uniform(4, 12, 2 * En)).astype(np.float32)
    state = {"scale_fwd": torch.from_numpy(scale_f.copy()),
             "amax_history_fwd": torch.from_numpy(hist_f.copy()),
             "scale_bwd": torch.from_numpy(scale_b.copy()),
             "amax_history_bwd": torch.from_numpy(hist_b.copy()),
             "extra_fp8_variables": {"num_gemms": En, "fp8_checkpoint": True}}
    fmt_te = getattr(te_recipe.Format, fmt)
    if version.startswith("1."):
        extra = io.BytesIO(_torch_save(state))
        recipe = DelayedScaling(margin=margin, fp8_format=getattr(Format, fmt),
                                amax_compute_algo=algo)
    else:
        state["recipe"] = te_recipe.DelayedScaling(margin=margin, fp8_format=fmt_te,
                                                   amax_history_len=L, amax_compute_algo=algo)
        extra, recipe = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8), None
    ours = from_te_extra_state(extra, te_version=version, recipe=recipe)
    assert ours["recipe"]["amax_compute_algo"] == algo and ours["recipe"]["margin"] == margin
    h, a, s, si = (ours[k].numpy().copy() for k in ("amax_history", "amax", "scale",
                                                    "scale_inv"))
    cols = te_columns(En, interleaved)
    fwd_max = np.full(3 * En, 448, np.float32)
    bwd_max = np.full(2 * En, fmt_te.value.max_bwd, np.float32)
    hybrid = "hybrid" if fmt == "HYBRID" else "e4m3"
    fmts = ["e4m3"] * (2 * En) + ["e5m2" if hybrid == "hybrid" else "e4m3"] * En
    for step in range(4):
        if step:        # a training step measured these amaxes (some experts got no tokens)
            new = (2.0 ** rng.uniform(-8, 8, 3 * En)).astype(np.float32)
            new[rng.random(3 * En) < 0.25] = 0
            for e, (ci, cw, cg) in enumerate(cols):
                hist_f[0, ci], hist_f[0, cw], hist_b[0, cg] = new[e], new[En + e], new[2 * En + e]
            a[:] = new
        te_update(hist_f, scale_f, fwd_max, margin, algo)
        te_update(hist_b, scale_b, bwd_max, margin, algo)
        update_scales(h, a, s, si, fp8_format=fmts, amax_compute_algo=algo, margin=margin,
                      reset_amax=True)
        te_scales = np.array([scale_f[c[0]] for c in cols] + [scale_f[c[1]] for c in cols]
                             + [scale_b[c[2]] for c in cols], np.float32)
        np.testing.assert_array_equal(s.view(np.uint32), te_scales.view(np.uint32),
                                      err_msg=f"step {step}")


def te_state_bytes(te_recipe, **recipe_kw):
    state = {"recipe": te_recipe.DelayedScaling(amax_history_len=2, **recipe_kw),
             "scale_fwd": torch.ones(6), "amax_history_fwd": torch.zeros(2, 6),
             "scale_bwd": torch.ones(4), "amax_history_bwd": torch.zeros(2, 4),
             "extra_fp8_variables": {"num_gemms": 2}}
    return state


def blob(obj):
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def my_amax_algo(history):      # a TE amax_compute_algo callable (pickled by reference)
    return history.max()


def test_bad_versions_recipes_and_states_are_named(te_recipe):
    ok = blob(te_state_bytes(te_recipe))
    assert from_te_extra_state(ok, te_version="2.4")["num_experts"] == 2
    for bad in ("latest", 2.9, "2", "1.8.0"):
        with pytest.raises(ValueError, match="te_version"):
            from_te_extra_state(ok, te_version=bad)
    with pytest.raises(ValueError, match="te_version: 1.13 does not store its recipe"):
        from_te_extra_state(ok, te_version="1.13")
    no_recipe = {k: v for k, v in te_state_bytes(te_recipe).items() if k != "recipe"}
    with pytest.raises(ValueError, match="te_version: this state has no recipe"):
        from_te_extra_state(blob(no_recipe), te_version="2.3")
    with pytest.raises(ValueError, match="te_version: this state has no recipe"):
        from_te_extra_state(blob(no_recipe), te_version="2.1")
    assert from_te_extra_state(blob(no_recipe), te_version="1.13")["recipe"]["fp8_format"] == \
        "hybrid"
    with pytest.raises(ValueError, match="recipe: this TransformerEngine state carries"):
        from_te_extra_state(ok, te_version="2.9", recipe=DelayedScaling())
    with pytest.raises(TypeError, match="recipe: expected a cugrouped.pytorch.DelayedScaling"):
        from_te_extra_state(blob(no_recipe), te_version="1.13", recipe="max")
    with pytest.raises(ValueError, match="fp8_format: pure E5M2"):
        from_te_extra_state(blob(te_state_bytes(te_recipe, fp8_format=te_recipe.Format.E5M2)),
                            te_version="2.9")
    with pytest.raises(ValueError, match=r"test_pytorch_te_checkpoint\.my_amax_algo.*"
                                         r"amax_compute_algo"):
        from_te_extra_state(blob(te_state_bytes(te_recipe, amax_compute_algo=my_amax_algo)),
                            te_version="2.9")
    wrong = {**te_state_bytes(te_recipe), "scale_bwd": torch.ones(5)}
    with pytest.raises(ValueError, match="not a TransformerEngine GroupedLinear FP8 state"):
        from_te_extra_state(blob(wrong), te_version="2.9")
    wrong = {**te_state_bytes(te_recipe), "extra_fp8_variables": {"num_gemms": 3}}
    with pytest.raises(ValueError, match="state of 3 GEMMs holds tensors for 2"):
        from_te_extra_state(blob(wrong), te_version="2.9")
    with pytest.raises(TypeError, match="extra_state: expected TransformerEngine's serialized"):
        from_te_extra_state(torch.ones(3), te_version="2.9")
    with pytest.raises(TypeError, match="extra_state: expected"):
        from_te_extra_state({"scale": 1}, te_version="2.9")
    with pytest.raises(TypeError, match="state_dict: expected a dict"):
        from_te_state_dict([ok], te_version="2.9")


def test_a_stateless_recipes_payload_is_not_unpickled(te_recipe):
    """TE 2.x before its stateless-recipe check pickled the recipe of current / block / MXFP8
    scaling with no tensors: no state, and nothing in it is unpickled (not even a global that
    would be refused)."""
    assert from_te_extra_state(blob({"recipe": os.system, "extra_fp8_variables": {}}),
                               te_version="2.1") is None


def test_loading_runs_no_code_from_the_checkpoint(tmp_path):
    """A pickle that would call os.system is refused by name before anything runs."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    state = {"amax_history_fwd": Evil()}
    with pytest.raises(ValueError, match=r"refers to (posix|os|nt)\.system"):
        from_te_extra_state(blob(state), te_version="2.9")
    assert not marker.exists()
    # nor any other global than a tensor's rebuild and TE's recipe classes
    with pytest.raises(ValueError, match=r"refers to builtins\.eval"):
        from_te_extra_state(blob({"amax_history_fwd": eval}), te_version="2.9")


def test_loading_changes_nothing_outside_the_checkpoint():
    """BUILD (set attributes) on an allowed global would change it for the whole process, e.g.
    torch's tensor rebuild made to negate every tensor loaded later: refused, nothing changed."""
    import pickletools

    def body(obj):              # a protocol-2 pickle's opcodes, without PROTO and STOP
        return pickle.dumps(obj, protocol=2)[2:-1]

    rebuild = torch._utils._rebuild_tensor_v2
    defaults = rebuild.__defaults__
    evil = (b"\x80\x02" + b"ctorch._utils\n_rebuild_tensor_v2\n"
            + body((None, {"__defaults__": ({"neg": True},)})) + b"b"     # BUILD on the function
            + b"0" + body({"amax_history_fwd": None}) + b".")
    with pytest.raises(ValueError, match="sets attributes of function"):
        from_te_extra_state(blob_bytes(pickletools.optimize(evil)), te_version="2.9")
    assert rebuild.__defaults__ == defaults


def blob_bytes(raw):
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
