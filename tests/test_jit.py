"""The JIT layer on a machine without a GPU: source discovery, include hashing, options, and a real
NVRTC compile (nothing mocked: CuPy's NVRTC program class and the NVRTC library from the wheel)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import cugrouped
from cugrouped import _compile_check, _jit, _sources

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_sources_found_and_readable():
    d = _sources.kernels_dir()
    assert (d / "pad_cast_transpose.cu").is_file()
    assert "pad_cast_transpose_kernel" in _sources.read_source("pad_cast_transpose.cu")
    assert "pad_cast_transpose.cu" in _sources.list_sources(".cu")


def test_transitive_includes_resolved_in_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "top.cu").write_text('#include "a.cuh"\n#include "sub/b.cuh"\n')
    (tmp_path / "a.cuh").write_text("// a\n")
    (tmp_path / "sub" / "b.cuh").write_text('#include "c.cuh"\n')   # beside the includer
    (tmp_path / "sub" / "c.cuh").write_text('  #  include "../a.cuh"\n')  # cycle back to a
    files = _sources.resolve_includes("top.cu", search=(tmp_path,))
    names = [p.relative_to(tmp_path).as_posix() for p in files]
    assert names[0] == "top.cu"
    assert sorted(names) == ["a.cuh", "sub/b.cuh", "sub/c.cuh", "top.cu"]


def test_missing_include_names_the_includer(tmp_path):
    (tmp_path / "top.cu").write_text('#include "nope.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nope.cuh.*top.cu"):
        _sources.resolve_includes("top.cu", search=(tmp_path,))


def test_digest_changes_when_a_nested_header_changes(tmp_path):
    (tmp_path / "top.cu").write_text('#include "mid.cuh"\n')
    (tmp_path / "mid.cuh").write_text('#include "leaf.cuh"\n')
    leaf = tmp_path / "leaf.cuh"
    leaf.write_text("#define X 1\n")
    d1 = _sources.source_digest("top.cu", search=(tmp_path,))
    assert d1 == _sources.source_digest("top.cu", search=(tmp_path,))
    leaf.write_text("#define X 2\n")
    d2 = _sources.source_digest("top.cu", search=(tmp_path,))
    assert d1 != d2


def test_code_string_carries_digest_of_real_kernel():
    spec = _jit.registered()["pad_cast_transpose"]
    code = _jit.code_for(spec)
    assert _sources.source_digest(spec.source) in code
    assert f'#include "{spec.source}"' in code
    # the digest covers the headers: fp8.cuh and common.cuh are reached through the source
    names = {p.name for p in _sources.resolve_includes(spec.source)}
    assert {"pad_cast_transpose.cu", "fp8.cuh", "common.cuh"} <= names


def test_options_match_rawmodule_and_drop_cuda_headers():
    spec = _jit.registered()["pad_cast_transpose"]
    ours = _jit.nvrtc_options(spec)
    assert "-std=c++17" in ours and f"-I{_sources.kernels_dir()}" in ours
    assert not any("fast_math" in o for o in ours)
    offline = _compile_check.offline_options(spec, "90")
    for flag in ("-ftz=true", "-arch=sm_90", "--device-as-default-execution-space", "-Xptxas=-v"):
        assert flag in offline
    assert not any(re.fullmatch(r"-I.*/cuda[^/]*/include/?", o) for o in offline)


def test_kernel_spec_rejects_bad_input():
    with pytest.raises(ValueError, match="name_expressions"):
        _jit.KernelSpec("x.cu", ())
    spec = _jit.registered()["pad_cast_transpose"]
    with pytest.raises(ValueError, match="not one of the instantiations"):
        _jit.get_function(spec, "cg::nope<int>")
    with pytest.raises(ValueError, match="registered twice"):
        _jit.register("pad_cast_transpose", _jit.KernelSpec("other.cu", ("k",)))


def test_offline_nvrtc_compile_reports_resources_and_catches_errors(tmp_path, monkeypatch):
    good = _jit.KernelSpec("pad_cast_transpose.cu", (_jit.registered()["pad_cast_transpose"].name_expressions[0],))
    image, mapping, log = _compile_check.compile_offline(good, "80")
    assert image[:4] == b"\x7fELF"
    res = _compile_check.parse_ptxas_log(log, "80", mapping)
    assert [r.name for r in res] == list(good.name_expressions)
    assert res[0].registers > 0 and res[0].spills == 0


def test_offline_compiles_are_remembered_on_disk(tmp_path, monkeypatch):
    """A compile is stored under CUGROUPED_COMPILE_CACHE and read back (NVRTC not called again);
    another instantiation list is another entry; ``0`` turns the cache off; a torn file is
    compiled again."""
    from cupy.cuda import compiler

    spec = _jit.registered()["scale_update"]
    monkeypatch.setenv("CUGROUPED_COMPILE_CACHE", str(tmp_path))
    first = _compile_check.compile_offline(spec, "90")
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    calls = []
    real = compiler._NVRTCProgram.compile
    monkeypatch.setattr(compiler._NVRTCProgram, "compile",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert _compile_check.compile_offline(spec, "90") == first and calls == []
    one = _jit.KernelSpec(spec.source, spec.name_expressions[:1])
    _compile_check.compile_offline(one, "90")
    assert calls == [1] and len(list(tmp_path.glob("*.pkl"))) == 2
    next(tmp_path.glob("*.pkl")).write_bytes(b"torn")
    _compile_check.compile_offline(spec, "90")
    _compile_check.compile_offline(one, "90")
    assert len(calls) == 2                      # the torn one compiled again, the other read
    monkeypatch.setenv("CUGROUPED_COMPILE_CACHE", "0")
    _compile_check.compile_offline(spec, "90")
    assert len(calls) == 3


@pytest.mark.parametrize("name", ["scale_update", "grouped_gemm_setup"])
def test_small_kernels_compile_for_every_arch_without_spills(name):
    """Every instantiation of the small kernels, every architecture, through the offline NVRTC
    path (pad_cast_transpose, 120 compiles, is checked by the test command's compile-check step and
    by test_cli on sm_90)."""
    spec = _jit.registered()[name]
    for arch in _compile_check.ARCHS:
        _, mapping, log = _compile_check.compile_offline(spec, arch)
        found = _compile_check.parse_ptxas_log(log, arch, mapping)
        assert {r.name for r in found} == set(spec.name_expressions), arch
        assert all(r.spills == 0 for r in found), found


def test_compile_check_fails_on_compile_error(tmp_path, monkeypatch):
    bad_dir = tmp_path / "k"
    bad_dir.mkdir()
    (bad_dir / "bad.cu").write_text("__global__ void bad(int* x) { x[0] = undeclared; }\n")
    monkeypatch.setattr(_sources, "kernels_dir", lambda: bad_dir)
    monkeypatch.setattr(_jit, "_REGISTRY", {"bad": _jit.KernelSpec("bad.cu", ("bad",))})
    lines: list[str] = []
    assert _compile_check.compile_check(("90",), echo=lines.append) == 1
    assert any("COMPILE ERROR" in ln and "undeclared" in ln for ln in lines)


def test_compile_check_fails_on_spills(tmp_path, monkeypatch):
    d = tmp_path / "k"
    d.mkdir()
    # A dynamically indexed local array too large for registers, capped to 32 registers: spills.
    (d / "spill.cu").write_text(
        "__global__ void __launch_bounds__(1024, 2) spill(float* x, int i) {\n"
        "  float a[256];\n"
        "  for (int j = 0; j < 256; ++j) a[j] = x[j * i];\n"
        "  float s = 0; for (int j = 0; j < 256; ++j) s += a[(j * 7 + i) & 255] * a[j];\n"
        "  x[0] = s; }\n")
    monkeypatch.setattr(_sources, "kernels_dir", lambda: d)
    monkeypatch.setattr(_jit, "_REGISTRY", {"spill": _jit.KernelSpec("spill.cu", ("spill",))})
    lines: list[str] = []
    code = _compile_check.compile_check(("90",), echo=lines.append)
    report = [ln for ln in lines if "spill" in ln and ln.startswith("sm_90")]
    assert report, lines
    # Either ptxas spilled (we must fail) or it kept the array in local memory without spilling;
    # the check must agree with what ptxas said.
    spilled = "SPILLS" in report[0]
    assert code == (1 if spilled else 0)


def test_jit_knobs_dump_generated_code(tmp_path, monkeypatch):
    monkeypatch.setenv("CUGROUPED_JIT_DUMP", str(tmp_path / "dump"))
    monkeypatch.setenv("CUGROUPED_JIT_VERBOSE", "1")
    spec = _jit.KernelSpec("pad_cast_transpose.cu", (_jit.registered()["pad_cast_transpose"].name_expressions[0],))
    _compile_check.compile_offline(spec, "90", method="ptx")
    dumped = list((tmp_path / "dump").glob("*.cu"))
    assert len(dumped) == 1 and _sources.source_digest(spec.source) in dumped[0].read_text()
    opts = list((tmp_path / "dump").glob("*.options.txt"))[0].read_text()
    assert "-arch=compute_90" in opts


def test_every_package_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(conf["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "cugrouped").rglob("__init__.py")}
    assert on_disk <= listed, f"add to pyproject packages: {sorted(on_disk - listed)}"
    assert conf["tool"]["setuptools"]["package-dir"]["cugrouped.kernels_cu"] == "kernels_cu"
    deps = " ".join(conf["project"]["dependencies"]) + " ".join(
        " ".join(v) for v in conf["project"]["optional-dependencies"].values())
    assert not re.search(r"(^|[\s\"'])dlpack\b", deps), "never depend on the PyPI package 'dlpack'"


def test_wheel_ships_kernel_sources_and_works_outside_checkout(tmp_path):
    """Build the wheel (no compiler involved), unpack it, import it from another folder."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheel_dir.glob("cugrouped-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for f in ("cugrouped/kernels_cu/pad_cast_transpose.cu", "cugrouped/kernels_cu/fp8.cuh",
              "cugrouped/kernels_cu/common.cuh", "cugrouped/emulate/cuda_emu.h"):
        assert f in names, f
    assert not any(n.endswith((".so", ".o")) for n in names), "the wheel must be pure Python"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", "import cugrouped, pathlib; d = cugrouped.kernel_sources(); "
         "print(d); print(len((d / 'pad_cast_transpose.cu').read_text()))"],
        cwd=elsewhere, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == str(site / "cugrouped" / "kernels_cu")
    assert int(out[1]) > 1000


def test_public_api():
    assert callable(cugrouped.multi_pad_cast_transpose)
    assert cugrouped.kernel_sources() == _sources.kernels_dir()


def test_sources_are_hashed_once_per_process_until_cleared(monkeypatch):
    """A launch must not re-read and re-hash the sources (~1 ms): the code string is computed once
    per spec, and clear_cache() makes the next launch pick up an edit."""
    spec = _jit.registered()["pad_cast_transpose"]
    calls = []
    real = _jit.code_for
    monkeypatch.setattr(_jit, "code_for", lambda s: calls.append(s) or real(s))
    _jit.clear_cache()
    first = _jit._code(spec)
    assert _jit._code(spec) is first and len(calls) == 1
    _jit.clear_cache()
    assert _jit._code(spec) == first and len(calls) == 2


def test_emulated_kernels_are_built_once_per_process():
    spec = _jit.registered()["scale_update"]
    name = spec.name_expressions[0]
    _jit.clear_cache()
    fn = _jit.get_emulated_function(spec, name)
    assert _jit.get_emulated_function(spec, name) is fn
    _jit.clear_cache()
    assert _jit.get_emulated_function(spec, name) is not fn
    with pytest.raises(ValueError, match="not one of the instantiations"):
        _jit.get_emulated_function(spec, "cg::nope")


@pytest.mark.skipif(__import__("cugrouped").gpu_available(), reason="the GPU-less behaviour")
def test_warmup_without_gpu_says_what_to_do_instead():
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible.*compile-check"):
        cugrouped.warmup()


def test_warmup_names_unknown_modules_before_anything_else():
    with pytest.raises(ValueError, match=r"names: unknown kernel modules \['nope'\]; known: .*"
                                         r"block_cast_transpose"):
        cugrouped.warmup(["block_cast_transpose", "nope"], parallel=True)


@pytest.mark.gpu
def test_parallel_warmup_loads_every_module():
    from cugrouped import _jit

    assert cugrouped.warmup(parallel=True) == list(_jit.registered())
