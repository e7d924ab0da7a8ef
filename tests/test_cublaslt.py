"""The cuBLASLt binding against the real ``libcublasLt`` (no fake library): loading, the version
query, every enum value checked against the installed headers (parsed, and compiled with the system
C compiler when one is present), and the descriptors, layouts and preferences created and every
attribute the GEMM op sets accepted with the size and value it uses, then read back. None of this
needs a GPU; ``cublasLtCreate`` does, and that is tested both ways."""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from cugrouped import cublaslt
from cugrouped.cublaslt import _enums as E
from cugrouped.cublaslt import descriptors as D

try:
    cublaslt.lib()
except OSError as exc:  # pragma: no cover - the test environment installs nvidia-cublas
    pytest.skip(f"libcublasLt not installed: {exc}", allow_module_level=True)


# ---------------------------------------------------------------------------------------------
# Headers: the wheel's include/ next to lib/, and CUDA toolkits.

def _include_dirs() -> list[str]:
    dirs = [os.path.normpath(os.path.join(os.path.dirname(cublaslt.library_path()), "..", "include"))]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                 *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        if root:
            dirs.append(os.path.join(root, "include"))
    return [d for d in dirs if os.path.isdir(d)]


def _find_header(name: str) -> str | None:
    for d in _include_dirs():
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


_HEADERS = ("cublasLt.h", "cublas_api.h", "library_types.h")


def _parse_enums(texts: list[str]) -> dict[str, int]:
    """``NAME = value`` pairs of every enum in the headers; values are literals, other names, or
    ``(NAME | literal)``."""
    raw = {}
    for text in texts:
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        for body in re.findall(r"typedef\s+enum\s*\w*\s*\{(.*?)\}", text, flags=re.S):
            for item in body.split(","):
                m = re.match(r"\s*(\w+)\s*=\s*(.+?)\s*$", item, flags=re.S)
                if m:
                    raw.setdefault(m.group(1), m.group(2))
    out: dict[str, int] = {}

    def value(name, depth=0):
        if name in out:
            return out[name]
        expr = raw[name]
        expr = re.sub(r"\b([A-Za-z_]\w*)\b", lambda t: str(value(t.group(1), depth + 1)), expr)
        expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)  # integer suffixes
        out[name] = int(eval(expr, {"__builtins__": {}}))
        return out[name]

    for name in raw:
        try:
            value(name)
        except Exception:
            pass
    return out


@pytest.fixture(scope="module")
def header_enums():
    paths = [_find_header(h) for h in _HEADERS]
    if not all(paths):
        pytest.skip(f"headers not found (looked in {_include_dirs()}): "
                    f"{[h for h, p in zip(_HEADERS, paths) if not p]}")
    return _parse_enums([open(p).read() for p in paths])


def _expected_names() -> list[str]:
    """The constants the installed headers must define: all of ours, but the grouped GEMM's when
    the library predates it (cuBLAS 13.1, as torch 2.11's CUDA build installs, has none)."""
    return sorted(k for k in E.HEADER_VALUES
                  if cublaslt.has_grouped_gemm() or k not in E.GROUPED_NAMES)


def test_every_hardcoded_enum_matches_the_headers(header_enums):
    assert E.HEADER_VALUES, "no values hard-coded?"
    mismatched = {k: (E.HEADER_VALUES[k], header_enums.get(k)) for k in _expected_names()
                  if header_enums.get(k) != E.HEADER_VALUES[k]}
    assert not mismatched, f"(ours, header) differ: {mismatched}"
    # a library without the grouped GEMM has a header without its names, and the other way round
    assert cublaslt.has_grouped_gemm() == all(k in header_enums for k in E.GROUPED_NAMES)


def test_header_parser_reads_expressions(header_enums):
    # two values the parser must compute rather than read: a name and an OR
    assert header_enums["CUBLASLT_POINTER_MODE_HOST"] == 0
    assert header_enums["CUBLASLT_EPILOGUE_RELU_AUX"] == 2 | 128


def test_enums_and_struct_layout_compiled_against_the_headers(tmp_path):
    """The strongest check: the C compiler evaluates the header enums and sizeof/offsetof."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not all(_find_header(h) for h in _HEADERS):
        pytest.skip("needs a C compiler and the cuBLAS + CUDA headers")
    names = _expected_names()
    src = ["#include <stdio.h>", "#include <stddef.h>", "#include <cublasLt.h>", "int main(void){"]
    src += [f'printf("{n} %lld\\n", (long long){n});' for n in names]
    src += ['printf("sizeof_algo %zu\\n", sizeof(cublasLtMatmulAlgo_t));',
            'printf("sizeof_heur %zu\\n", sizeof(cublasLtMatmulHeuristicResult_t));',
            'printf("off_ws %zu\\n", offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize));',
            'printf("off_state %zu\\n", offsetof(cublasLtMatmulHeuristicResult_t, state));',
            'printf("off_waves %zu\\n", offsetof(cublasLtMatmulHeuristicResult_t, wavesCount));',
            "return 0;}"]
    (tmp_path / "t.c").write_text("\n".join(src))
    incs = []
    for h in _HEADERS:
        d = os.path.dirname(_find_header(h))
        if d not in incs:
            incs.append(d)
    build = subprocess.run([cc, "t.c", "-o", "t"] + [f"-I{d}" for d in incs], cwd=tmp_path,
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the headers do not compile here: {build.stderr[-500:]}")
    got = dict(line.split() for line in
               subprocess.run([str(tmp_path / "t")], capture_output=True, text=True,
                              check=True).stdout.splitlines())
    assert {n: int(got[n]) for n in names} == {n: E.HEADER_VALUES[n] for n in names}
    H = cublaslt.HeuristicResult
    assert int(got["sizeof_algo"]) == ctypes.sizeof(cublaslt.MatmulAlgo)
    assert int(got["sizeof_heur"]) == ctypes.sizeof(H)
    assert int(got["off_ws"]) == H.workspaceSize.offset
    assert int(got["off_state"]) == H.state.offset
    assert int(got["off_waves"]) == H.wavesCount.offset


# ---------------------------------------------------------------------------------------------
# Library, version, errors.

def test_library_loads_with_every_prototype():
    lib = cublaslt.lib()
    for name in cublaslt._lib._PROTOTYPES:
        assert getattr(lib, name).argtypes is not None
    assert "cublasLt" in os.path.basename(cublaslt.library_path())


@pytest.fixture
def named_library(monkeypatch):
    """Load through ``CUGROUPED_CUBLASLT`` = the value given, then restore the usual library
    (the cache cleared both ways; a path to the same file is the same loaded copy)."""
    lib = cublaslt._lib

    def load(value: str):
        monkeypatch.setenv(lib.ENV_VAR, value)
        lib._library.cache_clear()
        return lib._library()

    yield load
    monkeypatch.delenv(lib.ENV_VAR, raising=False)
    lib._library.cache_clear()


def test_env_var_names_the_library(named_library, tmp_path, capsys):
    from cugrouped.__main__ import main

    real, usual = os.path.realpath(cublaslt.library_path()), cublaslt.version()
    folder = tmp_path / "other-cublas"      # another place for it, as a second wheel would be
    folder.mkdir()
    link = folder / os.path.basename(real)
    link.symlink_to(real)
    for value in (str(folder), str(link)):
        cdll, path = named_library(value)
        assert path == str(link)            # that one, not the one the search finds
        assert cublaslt.library_path() == str(link) and cublaslt.version() == usual
        assert cdll.cublasLtMatmul.argtypes is not None
    capsys.readouterr()
    assert main(["info"]) == 0      # says which library it loaded, and why that one
    assert f"({link}, named by CUGROUPED_CUBLASLT)" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "empty folder", "other library", "no cublasLt"])
def test_env_var_refuses_what_is_not_libcublaslt(named_library, tmp_path, case):
    if case == "missing":
        value = str(tmp_path / "nowhere")
    elif case == "empty folder":
        value = str(tmp_path)
    elif case == "other library":    # exports cublasLtMatmul through its dependencies only
        value = os.path.join(os.path.dirname(cublaslt.library_path()), "libcublas.so.13")
        if not os.path.isfile(value):
            pytest.skip("no libcublas.so.13 beside libcublasLt")
    else:                            # named like it, but some other shared object
        cxx = shutil.which("g++") or shutil.which("cc")
        if cxx is None:
            pytest.skip("no C compiler to build a stand-in shared object")
        src = tmp_path / "x.c"
        src.write_text("int not_cublas(void) { return 0; }\n")
        value = str(tmp_path / "libcublasLt.so.13")
        subprocess.run([cxx, "-shared", "-fPIC", "-x", "c", str(src), "-o", value], check=True)
    with pytest.raises(OSError, match=r"CUGROUPED_CUBLASLT=.*(expected a libcublasLt|holds "
                                      r"none of|is not libcublasLt)"):
        named_library(value)


def test_version_query():
    v = cublaslt.version()
    assert 110000 <= v < 200000, v  # major * 10000 + minor * 100 + patch
    assert cublaslt.cudart_version() >= 11000
    hdr = _find_header("cublas_api.h")
    if hdr and os.path.dirname(hdr) == os.path.normpath(
            os.path.join(os.path.dirname(cublaslt.library_path()), "..", "include")):
        text = open(hdr).read()
        major, minor, patch = (int(re.search(rf"#define CUBLAS_VER_{k} (\d+)", text).group(1))
                               for k in ("MAJOR", "MINOR", "PATCH"))
        assert v == major * 10000 + minor * 100 + patch


def test_status_names_and_error_message():
    err = cublaslt.CublasLtError("cublasLtMatmul", 7)
    assert str(err) == "cuBLASLt cublasLtMatmul failed with status 7 (CUBLAS_STATUS_INVALID_VALUE)"
    assert "unknown status" in str(cublaslt.CublasLtError("cublasLtMatmul", 999))


def test_wrong_attribute_size_is_reported_with_the_function_name():
    desc = D.MatmulDesc()
    buf = ctypes.c_int32(1)  # FAST_ACCUM is 1 byte: 4 bytes must be refused
    status = cublaslt.lib().cublasLtMatmulDescSetAttribute(
        desc.handle, E.CUBLASLT_MATMUL_DESC_FAST_ACCUM, ctypes.byref(buf), 4)
    assert status == E.CUBLAS_STATUS_INVALID_VALUE
    desc.close()


def test_handle_needs_a_device():
    """``cublasLtCreate`` needs a driver and a GPU: without one it fails with a named status."""
    from cugrouped import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: test_gpu_handle checks the handle")
    with pytest.raises(cublaslt.CublasLtError,
                       match=r"cuBLASLt cublasLtCreate failed with status \d+ \(CUBLAS_STATUS_"):
        cublaslt.Handle()


@pytest.mark.gpu
def test_gpu_handle():
    h = cublaslt.Handle()
    assert h.ptr
    h.close()


# Run in a fresh process (argv[1]: the device): torch first, its own libcublasLt mapped and (on a
# GPU) used; then cugrouped's GEMMs through the copy CUGROUPED_CUBLASLT names, beside torch's.
NAMED_COPY_SCRIPT = r"""
import os, sys
import torch
dev = sys.argv[1]
a = torch.randn(64, 64, device=dev)
(a @ a).sum().item()
from cugrouped import cublaslt, grouped_fprop
named = os.environ["CUGROUPED_CUBLASLT"]
assert cublaslt.library_path() == named, cublaslt.library_path()
maps = {ln.split()[-1] for ln in open("/proc/self/maps") if "libcublasLt" in ln}
print("mapped:", sorted(maps), "cugrouped's version:", cublaslt.version())
assert named in maps and len(maps) >= 2, maps
g = torch.Generator().manual_seed(0)
xs = [torch.randn(m, 64, generator=g).to(dev, torch.bfloat16) for m in (5, 0, 40)]
ws = [torch.randn(32, 64, generator=g).to(dev, torch.bfloat16) for _ in range(3)]
y = grouped_fprop(xs, ws, out_dtype="float32")
ref = torch.cat([x.double() @ w.double().T for x, w in zip(xs, ws)])
bound = 2.0**-20 * torch.cat([x.double().abs() @ w.double().abs().T for x, w in zip(xs, ws)])
assert y.device == xs[0].device and bool(((y.double() - ref).abs() <= bound).all())
print("OK")
"""


@pytest.mark.gpu
def test_gpu_named_copy_runs_beside_torchs(tmp_path):
    """CUGROUPED_CUBLASLT on a GPU: a second copy of libcublasLt (this one, copied to another
    file) loaded beside the one torch mapped and used, its per-expert bf16 GEMMs (fp32
    accumulation, exact products: 2^-20 of sum |x||w| bounds the error at k=64) right."""
    pytest.importorskip("torch")
    copy = tmp_path / "named" / "libcublasLt.so.13"
    copy.parent.mkdir()
    shutil.copyfile(os.path.realpath(cublaslt.library_path()), copy)
    env = dict(os.environ, CUGROUPED_CUBLASLT=str(copy))
    run = subprocess.run([sys.executable, "-c", NAMED_COPY_SCRIPT, "cuda"], env=env,
                         capture_output=True, text=True, timeout=80)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("OK"), run.stdout + run.stderr


# ---------------------------------------------------------------------------------------------
# Descriptors.

def test_matmul_desc_attributes_round_trip():
    with D.MatmulDesc() as desc:
        assert desc.get("COMPUTE_TYPE") == E.CUBLAS_COMPUTE_32F
        assert desc.get("SCALE_TYPE") == E.CUDA_R_32F
        for name, value in [("TRANSA", E.CUBLAS_OP_T), ("TRANSB", E.CUBLAS_OP_N),
                            ("EPILOGUE", E.CUBLASLT_EPILOGUE_BIAS), ("FAST_ACCUM", 1),
                            ("BIAS_DATA_TYPE", E.CUDA_R_16BF), ("POINTER_MODE", 0),
                            ("A_SCALE_POINTER", 0x7F12_3456_7890), ("B_SCALE_POINTER", 0x7F00_0000_0004),
                            ("BIAS_POINTER", 0x7F00_0000_0100)]:
            desc.set(name, value)
            assert desc.get(name) == value, name
    assert desc.handle is None


def test_layout_attributes_round_trip():
    with D.MatrixLayout(E.CUDA_R_8F_E4M3, 7168, 77, 7168) as lay:
        assert [lay.get(n) for n in ("TYPE", "ORDER", "ROWS", "COLS", "LD", "BATCH_COUNT")] == \
            [E.CUDA_R_8F_E4M3, E.CUBLASLT_ORDER_COL, 7168, 77, 7168, 1]
        lay.set("COLS", 0)  # an empty expert's layout is legal to describe
        assert lay.get("COLS") == 0


def test_preference_attributes_round_trip():
    with D.MatmulPreference() as pref:
        assert pref.get("MAX_WORKSPACE_BYTES") == 0  # the default the design warns about
        assert pref.get("MIN_ALIGNMENT_A_BYTES") == 256
        pref.set("MAX_WORKSPACE_BYTES", 32 << 20)
        for i, n in enumerate("ABCD"):
            pref.set(f"MIN_ALIGNMENT_{n}_BYTES", 2 << i)
        assert pref.get("MAX_WORKSPACE_BYTES") == 32 << 20
        assert [pref.get(f"MIN_ALIGNMENT_{n}_BYTES") for n in "ABCD"] == [2, 4, 8, 16]
        assert pref.get("SEARCH_MODE") == E.CUBLASLT_SEARCH_BEST_FIT


def test_caches_reuse_and_evict():
    D.clear_caches()
    cfg = D.GemmConfig(E.CUDA_R_16BF, E.CUDA_R_16BF, E.CUDA_R_16BF, E.CUBLAS_OP_T, E.CUBLAS_OP_N)
    assert D.matmul_desc(cfg) is D.matmul_desc(cfg)
    assert D.preference(1 << 20, 16, 16, 16, 16) is D.preference(1 << 20, 16, 16, 16, 16)
    first = D.matrix_layout(E.CUDA_R_16BF, 64, 1, 64)
    assert D.matrix_layout(E.CUDA_R_16BF, 64, 1, 64) is first
    old = D.LAYOUT_CACHE_SIZE
    try:
        D.LAYOUT_CACHE_SIZE = 3
        for m in range(2, 6):
            D.matrix_layout(E.CUDA_R_16BF, 64, m, 64)
        assert first.handle is None  # evicted and destroyed
        assert len(D._caches.layouts) == 3
    finally:
        D.LAYOUT_CACHE_SIZE = old
        D.clear_caches()


# ---------------------------------------------------------------------------------------------
# Grouped GEMM descriptors (cuBLAS 13.2+): created and read back without a GPU.

needs_grouped = pytest.mark.skipif(not cublaslt.has_grouped_gemm(),
                                   reason="this libcublasLt has no grouped GEMM (cuBLAS 13.2+)")


@needs_grouped
def test_grouped_layout_records_the_device_arrays():
    with D.GroupedMatrixLayout(E.CUDA_R_8F_E4M3, 8, 0x7F0000001000, 0x7F0000002000,
                               0x7F0000003000) as lay:
        assert lay.get("TYPE") == E.CUDA_R_8F_E4M3
        assert lay.get("BATCH_COUNT") == 8
        assert lay.get("BATCH_MODE") == E.CUBLASLT_BATCH_MODE_GROUPED
        assert (lay.get("ROWS_ARRAY"), lay.get("COLS_ARRAY"), lay.get("LD_ARRAY")) == \
            (0x7F0000001000, 0x7F0000002000, 0x7F0000003000)
        assert lay.get("ROWS_COLS_ARRAY_INTEGER_WIDTH") == E.CUBLASLT_INTEGER_WIDTH_32
        assert lay.get("LD_ARRAY_INTEGER_WIDTH") == E.CUBLASLT_INTEGER_WIDTH_32


@needs_grouped
def test_grouped_preferences_take_8_bytes_not_the_documented_4():
    """cublasLt.h documents the three GROUPED_* preferences as uint32_t; the library refuses 4
    bytes and takes 8 (as TransformerEngine and PyTorch pass them). Our table says int64."""
    with D.MatmulPreference() as pref:
        for name in ("GROUPED_AVERAGE_REDUCTION_DIM", "GROUPED_DESC_D_AVERAGE_ROWS",
                     "GROUPED_DESC_D_AVERAGE_COLS"):
            attr, ctype = D.PREFERENCE_ATTRS[name]
            four = ctypes.c_uint32(7)
            assert pref._setter(pref.handle, attr, ctypes.byref(four), 4) == \
                E.CUBLAS_STATUS_INVALID_VALUE
            assert ctypes.sizeof(ctype) == 8
            pref.set(name, 12345)
            assert pref.get(name) == 12345


def test_grouped_config_attributes_are_accepted():
    for scaled in (False, True):
        cfg = D.GemmConfig(E.CUDA_R_8F_E4M3 if scaled else E.CUDA_R_16BF,
                           E.CUDA_R_8F_E4M3 if scaled else E.CUDA_R_16BF, E.CUDA_R_16BF,
                           E.CUBLAS_OP_T, E.CUBLAS_OP_N, fast_accum=scaled, scaled=scaled,
                           grouped=True)
        with D.MatmulDesc() as desc:
            for name, value in cfg.attributes().items():
                desc.set(name, value)
                assert desc.get(name) == value, name
        assert cfg.attributes()["POINTER_MODE"] == E.CUBLASLT_POINTER_MODE_DEVICE
        assert ("A_SCALE_MODE" in cfg.attributes()) == scaled
