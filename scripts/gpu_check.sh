#!/usr/bin/env bash
# The one-command GPU check: every GPU test, then the benchmarks with short configs.
# Usage: scripts/gpu_check.sh OUT_DIR
# Needs only what a CUDA image with torch and CuPy already has (numpy, ml_dtypes, pytest): no
# network, no install; the checkout is put on PYTHONPATH. Target: under 8 minutes on one H200.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
cd "$ROOT"
if ! "$PY" -c "import cugrouped, sys; sys.exit(0 if cugrouped.gpu_available() else 1)"; then
    echo "gpu_check: no GPU visible to CuPy; nothing to check here (set CUGROUPED_GPU_CHECK_DRY=1 to run it anyway)"
    [ "${CUGROUPED_GPU_CHECK_DRY:-0}" = 1 ] || exit 2
fi
{
    echo "== gpu_check $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PY" -m cugrouped info
    echo "== GPU tests"
    "$PY" -m pytest -m "gpu" -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" tests
    tests_rc=$?
    if "$PY" -c "import nbmake, ipykernel" 2>/dev/null; then
        echo "== notebooks (GPU cells run here)"
        "$PY" -m pytest -q -p no:cacheprovider --nbmake --nbmake-kernel=python3 notebooks || tests_rc=1
    else
        echo "== notebooks skipped: nbmake/ipykernel not in this image"
    fi
    echo "== benchmarks"
    "$PY" -m cugrouped bench all --quick --out "$OUT"
    bench_rc=$?
    echo "== done: tests rc=$tests_rc bench rc=$bench_rc"
    exit $(( tests_rc || bench_rc ))
} 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
