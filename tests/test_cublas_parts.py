"""scripts/cublas_parts.py: a library split into xz parts here, carried one part per device call,
stashed there and joined back bit for bit (its SHA-256 checked); scripts/gpu_grouped_check.sh
stops before the GPU check while parts are missing; the GEMM probes (whose fourth times the grouped
GEMM that library brings) run through on the CPU."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import pathlib
import subprocess
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cublas_parts", ROOT / "scripts" / "cublas_parts.py")
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


@pytest.fixture
def library(tmp_path):
    """A 3 MiB stand-in for libcublasLt: half random bytes (xz keeps them), half a pattern."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3 << 19, dtype=np.uint8).tobytes() + bytes(range(256)) * 6144
    path = tmp_path / "src" / cp.LIB_NAME
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


def _carry(parts: pathlib.Path, device: pathlib.Path, names) -> None:
    """What one device call does to the tree there: the manifest and the named parts land."""
    device.mkdir(exist_ok=True)
    (device / "manifest.json").write_bytes((parts / "manifest.json").read_bytes())
    for name in names:
        (device / name).write_bytes((parts / name).read_bytes())


def test_parts_carried_one_by_one_join_to_the_same_bytes(library, tmp_path, capsys):
    src, data = library
    parts, device, stash = tmp_path / "parts", tmp_path / "device", tmp_path / "stash"
    manifest = cp.make(src, parts, 1 << 20, "test")
    names = [p["name"] for p in manifest["parts"]]
    assert len(names) >= 2 and all((parts / n).stat().st_size <= 1 << 20 for n in names)
    assert manifest["sha256"] == hashlib.sha256(data).hexdigest()
    assert json.loads((parts / "manifest.json").read_text()) == manifest
    for i, name in enumerate(names):
        _carry(parts, device, [name])
        assert cp.main(["stash", "--parts", str(device), "--stash", str(stash)]) == 0
        assert not (device / name).exists()            # moved out of the tree
        said = capsys.readouterr().out
        assert f"{i + 1} parts stashed" in said
        assert ("all there" in said) == (i == len(names) - 1)
    assert cp.main(["join", "--parts", str(device), "--stash", str(stash)]) == 0
    lib = pathlib.Path(capsys.readouterr().out.strip())
    assert lib == stash / cp.LIB_NAME and lib.read_bytes() == data
    assert not any((stash / n).exists() for n in names)    # only the library stays
    # joined once: a second join finds it (the parts are gone)
    assert cp.join(device, stash) == lib


def test_missing_and_damaged_parts_are_named_and_nothing_is_joined(library, tmp_path, capsys):
    src, _ = library
    parts, device, stash = tmp_path / "parts", tmp_path / "device", tmp_path / "stash"
    names = [p["name"] for p in cp.make(src, parts, 1 << 20, "test")["parts"]]
    _carry(parts, device, names[:1])
    assert cp.main(["join", "--parts", str(device), "--stash", str(stash)]) == 1
    err = capsys.readouterr().err
    assert f"missing {len(names) - 1} of {len(names)} parts: " + " ".join(names[1:]) in err
    assert not (stash / cp.LIB_NAME).exists()
    # a part damaged on the way is dropped, not joined
    _carry(parts, device, names[1:])
    bad = device / names[-1]
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    assert cp.join(device, stash) is None
    err = capsys.readouterr().err
    assert f"{names[-1]} does not match its SHA-256: dropped" in err and not bad.exists()
    assert f"missing 1 of {len(names)} parts: {names[-1]}" in err


def test_parts_of_another_library_left_in_the_stash_are_not_joined(library, tmp_path, capsys):
    """A machine still held may keep another make's parts (same names, same sizes): a new
    manifest clears them; a stashed part whose bytes changed is dropped at the join, and a
    join that still fails clears the stash and says so (no traceback, no partial file)."""
    src, data = library
    old, new = tmp_path / "old", tmp_path / "new"
    device, stash = tmp_path / "device", tmp_path / "stash"
    cp.make(src, old, 1 << 20, "old")
    (tmp_path / "src2").mkdir()
    other = tmp_path / "src2" / cp.LIB_NAME
    other.write_bytes(data[::-1])                      # the same size, other bytes
    names = [p["name"] for p in cp.make(other, new, 1 << 20, "new")["parts"]]
    _carry(old, device, names)
    assert cp.stash(device, stash)[1] == []            # the old library, complete
    _carry(new, device, names[:1])                     # a new make: only its first part so far
    present, missing = cp.stash(device, stash)
    assert present == names[:1] and missing == names[1:]
    _carry(new, device, names[1:])
    assert cp.stash(device, stash) == (names, [])
    assert cp.join(device, stash).read_bytes() == data[::-1]
    # a stashed part changed in place (same size): dropped at the join
    stash2 = tmp_path / "stash2"
    _carry(new, device, names)
    cp.stash(device, stash2)
    part = stash2 / names[0]
    part.write_bytes(bytes(b ^ 1 for b in part.read_bytes()))
    assert cp.join(device, stash2) is None
    assert f"{names[0]} did not match the manifest's SHA-256: dropped" in capsys.readouterr().err
    assert not part.exists()
    # parts that pass their checks but do not make the library (a wrong manifest): cleared
    stash3 = tmp_path / "stash3"
    _carry(new, device, names)
    cp.stash(device, stash3)
    manifest = json.loads((stash3 / "manifest.json").read_text())
    manifest["sha256"] = "0" * 64
    (stash3 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="wrong bytes.*the stash is cleared"):
        cp.join(tmp_path / "nowhere", stash3)
    assert not list(stash3.glob(f"{cp.LIB_NAME}*"))


def test_a_wheel_gives_its_libcublaslt(library, tmp_path):
    src, data = library
    wheel = tmp_path / "nvidia_cublas-0-py3-none-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("nvidia/cu13/lib/libcublas.so.13", b"not this one")
        z.write(src, cp.MEMBER)
    manifest = cp.make(wheel, tmp_path / "parts", 4 << 20, "0")
    assert manifest["bytes"] == len(data) and len(manifest["parts"]) == 1
    assert cp.join(tmp_path / "parts", tmp_path / "stash").read_bytes() == data


def test_device_calls_carry_the_manifest_with_each_part(library, tmp_path):
    src, _ = library
    manifest = cp.make(src, tmp_path / "parts", 1 << 20, "test")
    calls = cp.device_calls(manifest)
    assert len(calls) == len(manifest["parts"]) + 1
    for call, part in zip(calls, manifest["parts"]):
        assert f'[".cublas/manifest.json", ".cublas/{part["name"]}"]' in call
        assert "cublas_parts.py stash" in call
    assert "gpu_grouped_check.sh" in calls[-1]
    with pytest.raises(ValueError, match="part size: got 0 bytes"):
        cp.make(src, tmp_path / "p0", 0, "test")


def test_the_grouped_check_stops_while_parts_are_missing(tmp_path):
    env = dict(os.environ, CUGROUPED_CUBLAS_PARTS=str(tmp_path / "none"),
               CUGROUPED_CUBLAS_STASH=str(tmp_path / "stash"))
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_grouped_check.sh"),
                          str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "no manifest.json" in log and "not complete" in log


def test_the_gemm_probes_dry_run_every_probe(tmp_path):
    """scripts/gpu_probe_gemm.py on the CPU (CUGROUPED_PROBE_DRY=1): every probe runs through,
    the grouped one over both shapes, both kinds of splits and every pass, none failing."""
    env = dict(os.environ, CUGROUPED_PROBE_DRY="1")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_probe_gemm.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    grouped = [ln for ln in lines if ln.startswith("probe grouped ")]
    assert len(grouped) == 2 * 2 * 3 and all(": ran (dry)" in ln for ln in grouped), grouped
    assert sum(ln.startswith("probe scale pointer offset") for ln in lines) == 7
    assert sum(ln.startswith("probe algorithms") for ln in lines) == 2
    assert not [ln for ln in lines if "Error" in ln], lines


def test_the_any_m_benchmark_lifts_the_rule_for_its_run_only(capsys):
    """scripts/bench_grouped_any_m.py: the GEMM section with GROUPED_DIM_BYTES 1, nothing
    written, the rule back after (on the CPU: the host rows, the device ones skipped)."""
    from cugrouped.ops import _gemm_grouped

    spec = importlib.util.spec_from_file_location(
        "bench_grouped_any_m", ROOT / "scripts" / "bench_grouped_any_m.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seen = []
    import cugrouped.bench.gemm as bg
    from unittest import mock

    with mock.patch.object(bg, "bench_host_loop", lambda rows, **k: seen.append(
            _gemm_grouped.GROUPED_DIM_BYTES)):
        assert mod.main([]) == 0
    out = capsys.readouterr().out
    assert "GROUPED_DIM_BYTES 16 -> 1" in out and "no GPU here" in out
    assert seen == [1] and _gemm_grouped.GROUPED_DIM_BYTES == 16
