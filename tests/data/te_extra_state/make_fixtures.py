"""Writes the TransformerEngine GroupedLinear FP8 extra states that
tests/test_pytorch_te_checkpoint.py loads, byte for byte as TransformerEngine serializes them
(``get_extra_state`` in ``transformer_engine/pytorch/module/base.py``), without a GPU or
TransformerEngine installed.

Run once, from the checkout (needs torch, and pydantic for TE's recipe module):

    python tests/data/te_extra_state/make_fixtures.py /path/to/TransformerEngine.git

The recipe objects in the pickles are TransformerEngine's own classes: the recipe module
(``transformer_engine/common/recipe/__init__.py``, pure Python) is read from the given git
repository at each release tag and registered under its real name, so the pickles name
``transformer_engine.common.recipe.DelayedScaling`` & co. exactly as a TE checkpoint does.

A rerun gives the same values but not the same bytes: pickle stores each tensor's storage as a
nested legacy ``torch.save`` keyed by its address, as it does in TE's checkpoints.

Every stored value encodes what it is, so a test can check a conversion without knowing TE's
layout: ``value(role, expert, row) = 100 * (role + 1) + expert + 1 + row / 16`` for the amax
histories (row 0 is TE's pending amax), ``+ 0.5`` instead of the row term for the scales, where
role 0..4 = input, weight, output (forward tensors), grad output, grad input (backward). Where
each role's column sits follows TE's GroupedLinear of that release:

* TE 1.9 .. 2.2 ("blocked"): forward column ``role * E + e``, backward ``(role - 3) * E + e``;
* TE 2.3 and later ("interleaved"): forward ``3 * e + role``, backward ``2 * e + role - 3``.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
E = 4            # experts (num_gemms)


def value(role: int, expert: int, row: float) -> float:
    return 100.0 * (role + 1) + expert + 1 + row


def te_tensors(L: int, interleaved: bool) -> dict:
    fwd_hist, bwd_hist = torch.zeros(L, 3 * E), torch.zeros(L, 2 * E)
    fwd_scale, bwd_scale = torch.zeros(3 * E), torch.zeros(2 * E)
    for e in range(E):
        for role in range(5):
            fwd = role < 3
            r = role if fwd else role - 3
            col = ((3 if fwd else 2) * e + r) if interleaved else r * E + e
            hist, scale = (fwd_hist, fwd_scale) if fwd else (bwd_hist, bwd_scale)
            for row in range(L):
                hist[row, col] = value(role, e, row / 16)
            scale[col] = value(role, e, 0.5)
    return {"scale_fwd": fwd_scale, "amax_history_fwd": fwd_hist,
            "scale_bwd": bwd_scale, "amax_history_bwd": bwd_hist}


def te_recipe_module(te_git: str, tag: str) -> types.ModuleType:
    """TE's recipe module at ``tag``, registered as ``transformer_engine.common.recipe``."""
    src = subprocess.run(["git", "-C", te_git, "show", f"{tag}:transformer_engine/common/recipe/"
                          "__init__.py"], check=True, capture_output=True, text=True).stdout
    for name in ("transformer_engine", "transformer_engine.common"):
        sys.modules[name] = types.ModuleType(name)
    mod = types.ModuleType("transformer_engine.common.recipe")
    mod.__file__ = f"{te_git}@{tag}/transformer_engine/common/recipe/__init__.py"
    sys.modules[mod.__name__] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def te2_payload(te_git: str, tag: str, interleaved: bool, L: int, **recipe_kw) -> bytes:
    """TE 2.x: ``pickle.dumps`` of the state dict (CPU tensors), stored as a uint8 tensor."""
    rm = te_recipe_module(te_git, tag)
    kw = dict(recipe_kw)
    kw["fp8_format"] = getattr(rm.Format, kw["fp8_format"])
    state = {"recipe": rm.DelayedScaling(amax_history_len=L, **kw), **te_tensors(L, interleaved),
             "extra_fp8_variables": {"num_gemms": E, "fp8_checkpoint": True,
                                     "first_module": False}}
    return pickle.dumps(state)


def te1_payload(L: int) -> bytes:
    """TE 1.x (<= 1.13): ``torch.save`` of the state dict into an ``io.BytesIO``, the tensors
    on the GPU (here: CPU tensors whose storages are tagged ``cuda:0`` as a GPU's would be), with
    ``scale_inv_*`` and no recipe."""
    state = te_tensors(L, interleaved=False)
    state["scale_inv_fwd"] = 1.0 / state["scale_fwd"]
    state["scale_inv_bwd"] = 1.0 / state["scale_bwd"]
    state["extra_fp8_variables"] = {"num_gemms": E, "fp8_checkpoint": True,
                                    "fp8_max_fwd": 448.0, "fp8_max_bwd": 57344.0}
    torch.serialization.register_package(
        -1, lambda obj: "cuda:0" if isinstance(obj, (torch.storage.TypedStorage,
                                                     torch.storage.UntypedStorage)) else None,
        lambda obj, location: None)
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def main(te_git: str) -> None:
    files = {
        "te2.9_interleaved_hybrid.pkl": te2_payload(te_git, "v2.9", True, 8, margin=1,
                                                    fp8_format="HYBRID",
                                                    amax_compute_algo="max"),
        "te2.2_blocked_e4m3.pkl": te2_payload(te_git, "v2.2", False, 4, margin=0,
                                              fp8_format="E4M3",
                                              amax_compute_algo="most_recent"),
        "te1.13_bytesio.pt": te1_payload(6),
    }
    for name, data in files.items():
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
