#!/usr/bin/env bash
# The GPU check again, with a newer libcublasLt carried in parts (scripts/cublas_parts.py): its
# grouped GEMM runs where the image's cuBLAS 13.1 has none. Joins the parts stashed by earlier
# device calls, checks the library's SHA-256 and points CUGROUPED_CUBLASLT at it. Then, first
# and each in a process of its own (the grouped call never ran on a GPU: a fault there must not
# take the rest):
#   - the GEMMs' GPU tests (the default path is the grouped call wherever it can run);
#   - two probes (scripts/gpu_probe_gemm.py): grouped_gemm, the grouped call against the loop,
#     and scale_alignment, whether this cuBLAS still refuses the 4-byte-apart scale pointers
#     13.1 refused (a bug cuBLAS's notes say CUDA 13.1 Update 1 fixed [5728938]);
#   - the GEMM benchmark with the grouped path's 16-multiple rule lifted
#     (scripts/bench_grouped_any_m.py: rows printed only);
# within CUGROUPED_GROUPED_FIRST_S (default 300 s) together; then scripts/gpu_check.sh, with
# what is left of the 540 s, without the notebooks (the plain check runs them) and the probes
# (run here already). Everything goes to OUT_DIR/gpu_check.log as it happens (the first stages
# first: what a run cut short has done comes back) and to stdout.
# Usage: scripts/gpu_grouped_check.sh OUT_DIR    (exit 3: the library is not complete)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/gpu_grouped_check.sh OUT_DIR}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
if ! lib=$("$PY" "$ROOT/scripts/cublas_parts.py" join 2> "$LOG"); then
    cat "$LOG"
    echo "gpu_grouped_check: the carried libcublasLt is not complete (above)" | tee -a "$LOG"
    exit 3
fi
export CUGROUPED_CUBLASLT="$lib" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/cugrouped-cupy-cache}"
FIRST="${CUGROUPED_GROUPED_FIRST_S:-300}"
DEADLINE="${CUGROUPED_GPU_CHECK_DEADLINE_S:-540}"
rcfile="$(mktemp)"
cd "$ROOT"

# first NAME LIMIT CMD...: CMD under min(LIMIT, what is left of FIRST); skipped under 20 s
first() {
    local name="$1" limit="$2" left rc
    shift 2
    left=$((FIRST - SECONDS))
    (( limit > left )) && limit=$left
    if (( limit < 20 )); then
        echo "== $name: SKIPPED, ${SECONDS} s spent of the first stages' ${FIRST} s"
        return 124
    fi
    echo "== $name (limit ${limit} s)"
    timeout --signal=INT --kill-after=20 "$limit" "$@"
    rc=$?
    echo "== $name: rc=$rc at ${SECONDS} s"
    return "$rc"
}

{
    echo "== gpu_grouped_check $(date -u +%FT%TZ) at ${CUGROUPED_COMMIT:-?}: CUGROUPED_CUBLASLT=$lib"
    timeout 60 "$PY" -m cugrouped info
    first "GEMM GPU tests" "${CUGROUPED_GROUPED_TESTS_S:-150}" "$PY" -m pytest -m gpu -q \
        -p no:cacheprovider -rfEs tests/test_grouped_gemm.py tests/test_grouped_gemm_block.py \
        tests/test_cublaslt.py
    echo "$?" > "$rcfile"
    first "GEMM probes (scale alignment, grouped)" "${CUGROUPED_GROUPED_PROBE_S:-150}" \
        "$PY" scripts/gpu_probe_gemm.py scale_alignment grouped_gemm
    first "GEMM benchmark, any m" "${CUGROUPED_GROUPED_BENCH_S:-120}" \
        "$PY" scripts/bench_grouped_any_m.py
    true
} 2>&1 | tee -a "$LOG"
tests_rc=$(cat "$rcfile" 2>/dev/null || echo 1)
rm -f "$rcfile"
left=$((DEADLINE - SECONDS))
if (( left < 90 )); then
    echo "== gpu_check skipped: ${SECONDS} s spent, ${left} s left of ${DEADLINE}" | tee -a "$LOG"
    exit "$tests_rc"
fi
CUGROUPED_GPU_CHECK_LOG_APPEND=1 CUGROUPED_GPU_NOTEBOOKS_AFTER_S=0 CUGROUPED_GPU_PROBES_S=0 \
    CUGROUPED_GPU_CHECK_DEADLINE_S="$left" bash "$ROOT/scripts/gpu_check.sh" "$OUT"
rc=$?
exit $(( rc || tests_rc ))
