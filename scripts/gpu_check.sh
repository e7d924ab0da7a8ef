#!/usr/bin/env bash
# The one-command GPU check: every GPU test, then the benchmarks with short configs, then the
# notebooks (which CI already runs on the CPU).
# Usage: scripts/gpu_check.sh OUT_DIR
# Needs only what a CUDA image with torch and CuPy already has (numpy, ml_dtypes, pytest; uses
# pytest-timeout and pytest-xdist when present): no network; the checkout is put on PYTHONPATH.
# It installs nothing but the wheels carried in .whl/ (scripts/gpu_wheels.sh: the notebook
# runner), and of those only what the image lacks, into a temporary folder. Target: under 8
# minutes on one H200. Each stage has a time limit, so that a hang cannot eat the machine's
# lease: a stage stopped at its limit is reported and the next one runs.
# The whole script ends by CUGROUPED_GPU_CHECK_DEADLINE_S (default 540 s, under the device tool's
# 600 s per command): each stage's limit is cut to the time left, and a stage with under 20 s
# left is skipped, so the log, the XMLs, the CSV and the plots always come back.
# OUT_DIR receives at most 8 files: gpu_check.log, gpu_tests.xml, gpu_tests_block.xml, bench.csv
# and up to four PNGs (bench-cast.png, bench-gemm.png, bench-layer.png, bench-host.png).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# one CuPy kernel cache for the warm-up, the test workers, the bench and the notebooks, in a
# place that is writable whatever HOME is
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/cugrouped-cupy-cache}"
PY="${PYTHON:-python3}"
DEADLINE="${CUGROUPED_GPU_CHECK_DEADLINE_S:-540}"
# stage limits in seconds (override for a slower machine)
TESTS_S="${CUGROUPED_GPU_TESTS_S:-210}" BENCH_S="${CUGROUPED_GPU_BENCH_S:-170}"
BLOCK_S="${CUGROUPED_GPU_BLOCK_TESTS_S:-60}"
# Block scaling's and MXFP8's GPU tests (cuBLASLt's block scale modes, never run on a GPU before;
# MXFP8's GEMMs skip below sm_100, its casts run anywhere) in a stage
# of their own, after the others: a CUDA fault there poisons only its own processes' contexts.
BLOCK_TESTS=(tests/test_block_cast_transpose.py tests/test_grouped_gemm_block.py
             tests/test_pytorch_block_scaling.py tests/test_mxfp8_cast_transpose.py
             tests/test_grouped_gemm_mxfp8.py tests/test_pytorch_mxfp8.py
             tests/test_grouped_gemm_block_model.py tests/test_block_scaled_weights.py
             tests/test_pytorch_frozen.py tests/test_block_cast_swiglu.py)
NOTEBOOKS_S="${CUGROUPED_GPU_NOTEBOOKS_S:-90}"
cd "$ROOT"
LOG="$OUT/gpu_check.log"
# Wheels carried with the checkout (scripts/gpu_wheels.sh: the notebook runner the image lacks):
# the distributions the image does not have go into a folder appended to PYTHONPATH (nothing of
# the image's is shadowed); said in the log below.
WHEEL_MSG=""
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    SITE="${TMPDIR:-/tmp}/cugrouped-site"
    missing=$(timeout 60 "$PY" "$ROOT/scripts/missing_wheels.py" "$ROOT/.whl")
    if [ -z "$missing" ]; then
        WHEEL_MSG="gpu_check: .whl/: the image already has every distribution in it"
    # shellcheck disable=SC2086
    elif timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" $missing > "$SITE.log" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:$SITE"
        WHEEL_MSG="gpu_check: installed from .whl/ into $SITE: $(for w in $missing; do
            basename "$w" | cut -d- -f1; done | tr '\n' ' ')"
    else
        WHEEL_MSG="gpu_check: installing .whl/ failed ($(tail -n 1 "$SITE.log"));"
        WHEEL_MSG+=" the notebooks may skip"
    fi
fi
# what this image has (a missing package is named here, not mistaken for a missing GPU); the
# probes are time-limited too (a hung driver must not eat the lease) and start the log
timeout 60 "$PY" - <<'PYEOF' 2>&1 | tee ${CUGROUPED_GPU_CHECK_LOG_APPEND:+-a} "$LOG"
import importlib, shutil, sys, warnings
warnings.simplefilter("ignore")     # megatron.core warns that TE and Apex are absent
have = []
for name in ("numpy", "ml_dtypes", "cupy", "torch", "matplotlib", "pytest", "xdist",
             "pytest_timeout", "nbclient", "ipykernel", "megatron.core"):
    try:
        mod = importlib.import_module(name)
        have.append(f"{name} {getattr(mod, '__version__', '')}".strip())
    except Exception as exc:
        have.append(f"{name} MISSING ({type(exc).__name__}: {exc})")
print(f"gpu_check: python {sys.version.split()[0]}; " + "; ".join(have))
print("gpu_check: host compilers: " + (", ".join(c for c in ("gcc", "g++", "cc", "nvcc")
                                                   if shutil.which(c)) or "none"))
PYEOF
[ -n "$WHEEL_MSG" ] && echo "$WHEEL_MSG" | tee -a "$LOG"
if ! timeout 60 "$PY" -c "import cugrouped" >> "$LOG" 2>&1; then
    tail -n 20 "$LOG"
    echo "gpu_check: cugrouped does not import (above); nothing can be checked" | tee -a "$LOG"
    exit 3
fi
if ! timeout 60 "$PY" -c "import cugrouped, sys; sys.exit(0 if cugrouped.gpu_available() else 1)"; then
    echo "gpu_check: no GPU visible to CuPy; nothing to check here (set CUGROUPED_GPU_CHECK_DRY=1 to run it anyway)" | tee -a "$LOG"
    [ "${CUGROUPED_GPU_CHECK_DRY:-0}" = 1 ] || exit 2
fi

# stage NAME LIMIT CMD...: run CMD under a time limit (SIGINT first, so pytest still writes its
# report and the bench keeps its CSV), say how it ended and how long it took.
stage() {
    local name="$1" limit="$2" t0=$SECONDS rc left
    shift 2
    left=$((DEADLINE - SECONDS - 25))     # 20 s for a stopped stage to finish up, 5 to spare
    if (( left < 20 )); then
        echo "== $name: SKIPPED, ${SECONDS} s spent of the ${DEADLINE} s deadline"
        return 124
    fi
    (( limit > left )) && limit=$left
    echo "== $name (limit ${limit} s)"
    # SIGINT first: pytest writes its report, the bench its CSV, plots and targets (20 s)
    timeout --signal=INT --kill-after=20 "$limit" "$@"
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "== $name: STOPPED at its ${limit} s limit"
    fi
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    return "$rc"
}

{
    # the device machine gets the work tree without .git: pass CUGROUPED_COMMIT there
    echo "== gpu_check $(date -u +%FT%TZ) at ${CUGROUPED_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')}"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
        --format=csv,noheader || true
    timeout 60 "$PY" -m cugrouped info
    # compile every kernel once (NVRTC -> CuPy's disk cache), so that the test workers load them
    # instead of each compiling them inside a test's time limit
    stage "kernel warm-up" 120 "$PY" -c "import cugrouped, time; t = time.time(); \
print('compiled', cugrouped._jit.warmup(parallel=True), f'in {time.time() - t:.1f} s')"
    extra=() tests_env=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout=90); fi
    # references run on the CPU: 8 workers of 2 BLAS threads each on a 16-core host (for this
    # stage only: the benchmarks and notebooks keep the host's threads)
    # (and one Inductor compile thread each: test_gpu_torch_compile_and_training_step's worker
    # must not start a 16-process compile pool beside 7 busy workers)
    if "$PY" -c "import xdist" 2>/dev/null; then
        extra+=(-n 8)
        tests_env=(env OMP_NUM_THREADS=2 TORCHINDUCTOR_COMPILE_THREADS=1)
    fi
    ignore=()
    for f in "${BLOCK_TESTS[@]}"; do ignore+=(--ignore="$f"); done
    stage "GPU tests" "$TESTS_S" "${tests_env[@]}" "$PY" -m pytest -m gpu -q -p no:cacheprovider \
        -rfEs "${extra[@]}" "${ignore[@]}" --junitxml="$OUT/gpu_tests.xml" tests
    tests_rc=$?
    stage "GPU tests, block scaling" "$BLOCK_S" "${tests_env[@]}" "$PY" -m pytest -m gpu -q \
        -p no:cacheprovider -rfEs "${extra[@]}" --junitxml="$OUT/gpu_tests_block.xml" \
        "${BLOCK_TESTS[@]}"
    block_rc=$?
    stage "benchmarks" "$BENCH_S" "$PY" -m cugrouped bench all --quick --out "$OUT"
    bench_rc=$?
    # measurements, not checks (their outcome does not set the exit code): the scale pointer
    # alignments cuBLASLt accepts and the GEMMs' accumulation error at larger k
    if [ "${CUGROUPED_GPU_PROBES_S:-60}" = 0 ]; then
        echo "== GEMM probes skipped (CUGROUPED_GPU_PROBES_S=0)"
    else
        stage "GEMM probes" "${CUGROUPED_GPU_PROBES_S:-60}" "$PY" scripts/gpu_probe_gemm.py
    fi
    nb_rc=0
    if (( SECONDS > ${CUGROUPED_GPU_NOTEBOOKS_AFTER_S:-400} )); then
        echo "== notebooks skipped: ${SECONDS} s spent already (CI runs them on the CPU)"
    elif "$PY" -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
        # figures to a scratch folder: OUT_DIR keeps to its 8 files
        CUGROUPED_BENCH_CSV="$OUT/bench.csv" CUGROUPED_FIGURES_DIR="$(mktemp -d)" \
            stage "notebooks (GPU cells run here)" "$NOTEBOOKS_S" \
            "$PY" -m pytest -q -p no:cacheprovider tests/test_notebooks.py
        nb_rc=$?
    else
        echo "== notebooks skipped: nbclient/ipykernel not in this image (CI runs them on the CPU)"
    fi
    echo "== done in $SECONDS s: tests rc=$tests_rc block tests rc=$block_rc bench rc=$bench_rc" \
        "notebooks rc=$nb_rc"
    exit $(( tests_rc || block_rc || bench_rc || nb_rc ))
} 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
