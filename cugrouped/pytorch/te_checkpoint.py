"""TransformerEngine checkpoints of ``GroupedLinear`` into cugrouped, FP8 delayed-scaling state
included.

Parameter names are the same in both libraries (``weight{i}`` / ``bias{i}``), so only the FP8
extra state needs converting: TransformerEngine serializes it (a pickle in a uint8 tensor since
2.0; ``torch.save`` into an ``io.BytesIO`` before), with its own recipe class inside, and lays the
tensors out differently. ::

    sd = torch.load("te_checkpoint.pt", weights_only=True)    # TE's own state_dict (TE 2.x)
    layer.load_state_dict(from_te_state_dict(sd, te_version="2.9"))

What the conversion keeps (every value bit for bit): per expert, the scale and amax history of
the input, the weight and the grad output, and the recipe's format, margin and amax algorithm;
so the next scale update computes what TransformerEngine's would have (except where an amax is
a denormal float32: cugrouped counts it as "nothing measured", TE rolls it in). TE's history
``(L, T)`` keeps the pending amax in row 0 and the past ones in rows ``1 .. L-1`` (newest
last); cugrouped's ``(3E, L)`` is newest first with the pending amax apart. TE's scales of GEMM
outputs and grad inputs are unused by both libraries and dropped. The layout changed in TE 2.3
(one GEMM's tensors side by side instead of each role's experts side by side) and the
checkpoint does not say which it has: hence ``te_version`` (a development build labelled
2.3.0.dev0 from before 2025-04-14 wrote the old order: pass ``"2.2"`` for it).

Loading never runs code from the checkpoint: the pickle is read by an unpickler that knows only
torch's tensor rebuild (storages through ``torch.load(weights_only=True)``) and data-only
stand-ins for TE's recipe classes, and sets attributes on nothing else; any other global is
refused with its name. TE 1.x's ``io.BytesIO`` entries are read with
``torch.load(weights_only=True)``. The file around them is the caller's to load: TE 2.x
checkpoints load with ``torch.load(weights_only=True)``; TE 1.x ones hold ``io.BytesIO``
objects, which only ``weights_only=False`` loads, trusting the whole file. (TransformerEngine
itself now refuses these pickles unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``: its loader
would run any code they name.) TransformerEngine need not be installed.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import re

import torch

from ..reference import fp8 as rfp8
from .recipe import DelayedScaling, Format

__all__ = ["from_te_state_dict", "from_te_extra_state"]

_TE_RECIPE = "transformer_engine.common.recipe"
_FORMATS = {(448, 448): Format.E4M3, (448, 57344): Format.HYBRID, (57344, 57344): Format.E5M2}


# -- the unpickler ------------------------------------------------------------------------------
class _TEFormat:
    """Stand-in for ``transformer_engine.common.recipe.Format``: pickled as the class called on
    the member's value, a ``_FormatHelper(max_fwd, max_bwd)``."""

    def __new__(cls, value):
        fmt = _FORMATS.get(tuple(int(v) for v in value))
        if fmt is None:
            raise ValueError(f"state_dict: TransformerEngine FP8 format with maxima {tuple(value)} "
                             f"has no cugrouped counterpart (E4M3, HYBRID)")
        return fmt


class _TEFormatHelper(tuple):
    """Stand-in for TE's ``_FormatHelper`` named tuple ``(max_fwd, max_bwd)``."""

    def __new__(cls, *values):
        return tuple.__new__(cls, values)


class _TERecipe:
    """Stand-in for a TE recipe dataclass (data only): the pickle restores its fields (BUILD,
    which :class:`_Unpickler` allows on these instances only)."""

    _te_class = "Recipe"

    def _restore(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:    # (dict, slots) with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ValueError("state_dict: a TransformerEngine recipe in the FP8 extra state has "
                             "an unexpected pickled state")
        self.__dict__.update(state)


def _te_recipe_class(name: str) -> type:
    return type(name, (_TERecipe,), {"_te_class": name})


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` (a storage torch.save'd into the pickle), safely."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    (_TE_RECIPE, "Format"): _TEFormat,
    (_TE_RECIPE, "_FormatHelper"): _TEFormatHelper,
}


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, restricted: globals from :data:`_ALLOWED` and TE recipe
    stand-ins only, and BUILD (which sets attributes) only on a recipe stand-in, never on an
    allowed function or class (that would change it for the whole process)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == _TE_RECIPE and name[:1].isupper():
            return _te_recipe_class(name)
        hint = (" (a function stored in TE's recipe, such as a callable amax_compute_algo, is not "
                "supported)" if module != _TE_RECIPE and not module.startswith("torch") else "")
        raise ValueError(f"state_dict: the FP8 extra state refers to {module}.{name}, which "
                         f"cugrouped does not load from a checkpoint{hint}")

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if not isinstance(inst, _TERecipe):
            raise ValueError(f"state_dict: the FP8 extra state sets attributes of "
                             f"{type(inst).__name__}, which cugrouped does not allow")
        _TERecipe._restore(inst, state)

    dispatch[pickle.BUILD[0]] = load_build


def _read(extra_state):
    """TE's serialized extra state -> its dict (or None)."""
    if isinstance(extra_state, io.BytesIO):                 # TE 1.x: torch.save
        extra_state.seek(0)
        return torch.load(extra_state, map_location="cpu", weights_only=True)
    if isinstance(extra_state, torch.Tensor):               # TE 2.x (and 1.x in ONNX export)
        if extra_state.numel() == 0:
            return None
        if extra_state.dtype != torch.uint8 or extra_state.dim() != 1:
            raise TypeError(f"extra_state: expected TransformerEngine's serialized state (a 1-D "
                            f"uint8 tensor), got a {tuple(extra_state.shape)} {extra_state.dtype} "
                            f"tensor")
        raw = extra_state.detach().cpu().contiguous().numpy().tobytes()
        if b"amax_history_fwd" not in raw:      # no delayed-scaling state: nothing to unpickle
            return None
        return _Unpickler(io.BytesIO(raw)).load()
    raise TypeError(f"extra_state: expected TransformerEngine's serialized state (a uint8 tensor "
                    f"or an io.BytesIO), got {type(extra_state).__name__}")


# -- the conversion -----------------------------------------------------------------------------
def _parse_version(te_version) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", te_version) if isinstance(te_version, str) else None
    if m is None:
        raise ValueError(f"te_version: expected the TransformerEngine version that wrote the "
                         f"checkpoint as a string such as '2.9' or '1.13.0', got {te_version!r}")
    version = int(m[1]), int(m[2])
    if version < (1, 9):
        raise ValueError(f"te_version: GroupedLinear first appeared in TransformerEngine 1.9, "
                         f"got {te_version!r}")
    return version


def _recipe_from_te(te_recipe) -> DelayedScaling:
    name = getattr(te_recipe, "_te_class", type(te_recipe).__name__)
    if name != "DelayedScaling":
        raise ValueError(f"state_dict: a delayed-scaling state whose recipe is TE's {name}")
    fields = te_recipe.__dict__
    kw = {k: fields[k] for k in ("margin", "amax_history_len", "amax_compute_algo", "reduce_amax",
                                 "fp8_format") if k in fields}
    if fields.get("scaling_factor_compute_algo") is not None:
        raise ValueError("state_dict: TE's scaling_factor_compute_algo (a custom scale function) "
                         "is not supported")
    return DelayedScaling(**kw)


def _column_indices(E: int, interleaved: bool) -> tuple[list[int], list[int]]:
    """TE's forward columns of (every expert's input, every expert's weight) and backward columns
    of every expert's grad output: cugrouped's tensor order."""
    if interleaved:     # TE >= 2.3: _offsets input 0, weight 1 of 3 per GEMM; grad_output 0 of 2
        return [3 * e for e in range(E)] + [3 * e + 1 for e in range(E)], [2 * e for e in range(E)]
    return list(range(2 * E)), list(range(E))  # TE 1.9 .. 2.2: input 0, weight E; grad_output 0


def _tensor(state: dict, key: str, shape_desc: str) -> torch.Tensor:
    t = state.get(key)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"state_dict: TransformerEngine FP8 state lacks {key} ({shape_desc})")
    return t.detach().to(device="cpu", dtype=torch.float32)


def _convert(state: dict, version: tuple[int, int], recipe: DelayedScaling | None) -> dict:
    has_recipe = "recipe" in state
    if has_recipe and version < (2, 0):
        raise ValueError(f"te_version: {version[0]}.{version[1]} does not store its recipe, but "
                         f"this state does (TransformerEngine 2.0 or later wrote it)")
    if not has_recipe and version >= (2, 0):
        raise ValueError(f"te_version: this state has no recipe, so TransformerEngine 1.x wrote "
                         f"it (2.0 and later store theirs), not {version[0]}.{version[1]}")
    if has_recipe and recipe is not None:
        raise ValueError("recipe: this TransformerEngine state carries its own recipe; pass "
                         "recipe only for TE 1.x checkpoints, which do not")
    if recipe is not None and not isinstance(recipe, DelayedScaling):
        raise TypeError(f"recipe: expected a cugrouped.pytorch.DelayedScaling, got "
                        f"{type(recipe).__name__}")
    extra = state.get("extra_fp8_variables")
    extra = extra if isinstance(extra, dict) else {}
    if has_recipe:
        base = _recipe_from_te(state["recipe"])
    else:   # TE 1.x: no recipe (TE 2.4+ loads such a state with its default DelayedScaling())
        base = recipe or DelayedScaling()
        maxima = (extra.get("fp8_max_fwd"), extra.get("fp8_max_bwd"))
        try:
            fmt = _FORMATS.get((int(maxima[0]), int(maxima[1])))
        except (TypeError, ValueError):     # not recorded
            fmt = None
        if fmt is not None and recipe is None:
            base = dataclasses.replace(base, fp8_format=fmt)     # the format TE 1.x recorded
        elif fmt is not None and fmt is not recipe.fp8_format:
            raise ValueError(f"recipe: fp8_format {recipe.fp8_format} differs from the "
                             f"{fmt} this TransformerEngine state was trained with (its FP8 "
                             f"maxima {maxima})")

    scale_f = _tensor(state, "scale_fwd", "3 per expert")
    hist_f = _tensor(state, "amax_history_fwd", "(L, 3 per expert)")
    scale_b = _tensor(state, "scale_bwd", "2 per expert")
    hist_b = _tensor(state, "amax_history_bwd", "(L, 2 per expert)")
    T = scale_f.numel()
    E, L = T // 3, (hist_f.shape[0] if hist_f.dim() == 2 else -1)
    want = {"scale_fwd": (3 * E,), "amax_history_fwd": (L, 3 * E), "scale_bwd": (2 * E,),
            "amax_history_bwd": (L, 2 * E)}
    got = {"scale_fwd": scale_f, "amax_history_fwd": hist_f, "scale_bwd": scale_b,
           "amax_history_bwd": hist_b}
    bad = {k: tuple(got[k].shape) for k in want if tuple(got[k].shape) != want[k]}
    if E == 0 or T % 3 or L < 1 or bad:
        raise ValueError(f"state_dict: not a TransformerEngine GroupedLinear FP8 state (3 forward "
                         f"and 2 backward tensors per expert, histories (L, tensors)): shapes "
                         f"{ {k: tuple(v.shape) for k, v in got.items()} }")
    n_gemms = extra.get("num_gemms", E)
    if n_gemms != E:
        raise ValueError(f"state_dict: TransformerEngine FP8 state of {n_gemms} GEMMs holds "
                         f"tensors for {E}")

    fwd, bwd = _column_indices(E, interleaved=version >= (2, 3))
    hist = torch.cat([hist_f[:, fwd], hist_b[:, bwd]], dim=1)          # (L, 3E), TE's rows
    scale = torch.cat([scale_f[fwd], scale_b[bwd]])
    ours = torch.zeros(3 * E, L, dtype=torch.float32)
    ours[:, :L - 1] = hist[1:].flip(0).t()           # newest first; the oldest slot stays 0
    scale_inv = torch.from_numpy(rfp8.scale_inverse(scale.numpy()))
    r = dataclasses.replace(base, amax_history_len=L)
    return {"recipe": {"margin": r.margin, "fp8_format": r.fp8_format.value,
                       "amax_history_len": L, "amax_compute_algo": r.amax_compute_algo},
            "num_experts": E, "amax_history": ours.contiguous(), "amax": hist[0].clone(),
            "scale": scale.contiguous(), "scale_inv": scale_inv}


def from_te_extra_state(extra_state, *, te_version: str, recipe: DelayedScaling | None = None):
    """One TE GroupedLinear ``_extra_state`` entry as cugrouped's (a dict of tensors), or None
    when it holds no delayed-scaling state (trained without FP8, or with a recipe that keeps no
    state: current, block or MXFP8 scaling).

    ``te_version``: the TransformerEngine version that wrote it (``"2.9"``, ``"1.13.0"``...),
    which decides the tensors' layout. ``recipe``: for TE 1.x checkpoints only, which do not
    store theirs: the ``DelayedScaling`` they were trained with (margin, amax algorithm; the
    history length comes from the checkpoint, and the format is checked against the FP8 maxima
    TE 1.x recorded); default TE's default, ``DelayedScaling()``, in the recorded format.
    """
    version = _parse_version(te_version)
    state = _read(extra_state)
    if state is None or "amax_history_fwd" not in state:
        return None
    if not isinstance(state, dict):
        raise ValueError(f"extra_state: expected TransformerEngine's state dict inside, got "
                         f"{type(state).__name__}")
    return _convert(state, version, recipe)


def from_te_state_dict(state_dict, *, te_version: str, recipe: DelayedScaling | None = None):
    """A copy of a TransformerEngine ``state_dict`` (of a ``GroupedLinear``, or of a model holding
    some) that cugrouped's ``GroupedLinear`` loads: the ``_extra_state`` of every GroupedLinear
    (an entry beside a ``weight0``, or beside a 3-D ``weight``) converted by
    :func:`from_te_extra_state` (one without delayed-scaling state becomes TE's "no FP8 state",
    ``torch.empty(0, dtype=torch.uint8)``); everything else as it is, the same objects (the
    extra state of TE's other modules too: ``Linear`` and ``LayerNormMLP`` lay theirs out
    alike, but are not experts).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: expected a dict (a module's state_dict), got "
                        f"{type(state_dict).__name__}")
    out = type(state_dict)() if isinstance(state_dict, collections.OrderedDict) else {}
    for key, value in state_dict.items():
        module = key[:-len("_extra_state")]
        if (key.endswith("_extra_state") and isinstance(value, (torch.Tensor, io.BytesIO))
                and (f"{module}weight0" in state_dict or f"{module}weight" in state_dict
                     and getattr(state_dict[f"{module}weight"], "dim", lambda: 0)() == 3)):
            value = from_te_extra_state(value, te_version=te_version, recipe=recipe)
            if value is None:
                value = torch.empty(0, dtype=torch.uint8)
        out[key] = value
    if hasattr(state_dict, "_metadata"):
        out._metadata = state_dict._metadata
    return out
