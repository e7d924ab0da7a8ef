#!/usr/bin/env bash
# The test command (README): set up .venv if needed, compile every kernel for sm_80/89/90/100 with
# NVRTC (no GPU needed; fails on a compile error or a spill), then run the test suite.
# GPU tests are skipped with a reason on a machine without a GPU (scripts/gpu_check.sh runs them).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m exhaustive` for the 2^32 FP8 sweep, or
# `scripts/test.sh tests/test_scatter_rows.py -k order` for one file: without a path pytest runs
# the testpaths of pyproject.toml (tests/), with one only what it names.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
python -m cugrouped compile-check
# tests/test_notebooks.py runs the notebooks top to bottom too (GPU-only cells say why they skip)
# and saves their figures under build/notebook-figures/.
python -m pytest "$@"
