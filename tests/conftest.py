"""Shared test configuration.

Tests marked ``gpu`` need a CUDA device; without one they are skipped with a reason, and
``scripts/gpu_check.sh`` runs them on a machine that has one.
"""

from __future__ import annotations

import pytest


def _gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver on this machine
        return f"no CUDA driver/device ({type(exc).__name__})"
    return None if n > 0 else "no CUDA device"


_GPU_SKIP = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if _GPU_SKIP is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {_GPU_SKIP}; run scripts/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_tests_cast_cpu_layers_with_the_reference(request):
    """A GPU test that compares with a CPU GroupedLinear runs that layer's casts on the NumPy
    reference (the emulator's bits, which the CPU tests check): the emulator would first build
    every kernel with g++, costing the GPU check tens of seconds per worker and needing a host
    compiler on the GPU machine. A test that wants the emulator sets it inside."""
    if "gpu" not in request.keywords:
        yield
        return
    try:
        from cugrouped.pytorch import cpu_cast_backend
    except ImportError:             # no torch: no layer to configure
        yield
        return
    with cpu_cast_backend("reference"):
        yield
