"""The host harnesses of kernels_cu's headers (tests/*_sweep.cpp), built with g++ in plain host
mode: the portable code the CPU emulator runs, loaded with ctypes (tests only)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_harness(tmp_path_factory, source: pathlib.Path) -> pathlib.Path:
    """``source`` compiled to a shared library (IEEE arithmetic: no fast math, no contraction);
    the test is skipped without a C++ compiler."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip(f"no C++ compiler (g++) to build {source.relative_to(ROOT)}")
    so = tmp_path_factory.mktemp(source.stem) / f"lib{source.stem}.so"
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fno-fast-math",
           "-ffp-contract=off", "-shared", "-fPIC", f"-I{ROOT / 'kernels_cu'}", str(source),
           "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return so
