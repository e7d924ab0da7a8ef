#!/usr/bin/env bash
# The GPU check again, with a newer libcublasLt carried in parts (scripts/cublas_parts.py): its
# grouped GEMM runs where the image's cuBLAS 13.1 has none. Joins the parts stashed by earlier
# device calls, checks the library's SHA-256 and points CUGROUPED_CUBLASLT at it. Then, first
# and each in a process of its own (the grouped call never ran on a GPU: a fault there must not
# take the rest), the GEMMs' GPU tests and two probes (scripts/gpu_probe_gemm.py: grouped_gemm,
# the grouped call against the loop; scale_alignment, whether this cuBLAS still refuses the
# 4-byte-apart scale pointers 13.1 refused, a bug cuBLAS's notes say CUDA 13.1 Update 1 fixed
# [5728938]), and the GEMM benchmark with that rule lifted (scripts/bench_grouped_any_m.py: rows
# printed only); then scripts/gpu_check.sh without the notebooks (the plain check runs them) and
# without the probes (run here already). The first
# stages' output ends gpu_check.log (OUT_DIR keeps to gpu_check.sh's 8 files).
# Usage: scripts/gpu_grouped_check.sh OUT_DIR    (exit 3: the library is not complete)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: scripts/gpu_grouped_check.sh OUT_DIR}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if ! lib=$("$PY" "$ROOT/scripts/cublas_parts.py" join 2> "$OUT/gpu_check.log"); then
    cat "$OUT/gpu_check.log"
    echo "gpu_grouped_check: the carried libcublasLt is not complete (above)" | tee -a "$OUT/gpu_check.log"
    exit 3
fi
export CUGROUPED_CUBLASLT="$lib" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/cugrouped-cupy-cache}"
first="$(mktemp)"
cd "$ROOT"
{
    echo "== gpu_grouped_check: CUGROUPED_CUBLASLT=$lib"
    timeout 60 "$PY" -m cugrouped info
    # every GEMM GPU test: with this library the default path is the grouped call wherever it
    # can run (per-tensor and block-scaled), test_gpu_grouped_vs_loop_vs_reference forces it
    echo "== GEMM GPU tests (limit ${CUGROUPED_GROUPED_TESTS_S:-150} s)"
    timeout --signal=INT --kill-after=20 "${CUGROUPED_GROUPED_TESTS_S:-150}" "$PY" -m pytest -m gpu \
        -q -p no:cacheprovider -rfEs tests/test_grouped_gemm.py tests/test_grouped_gemm_block.py \
        tests/test_cublaslt.py
    echo "== GEMM GPU tests: rc=$?"
    echo "== grouped probe (limit ${CUGROUPED_GROUPED_PROBE_S:-150} s)"
    timeout --signal=INT --kill-after=20 "${CUGROUPED_GROUPED_PROBE_S:-150}" "$PY" \
        scripts/gpu_probe_gemm.py scale_alignment grouped_gemm
    echo "== grouped probe: rc=$?"
    # the benchmark's GEMM rows with the 16-multiple rule lifted: its jagged counts' fprop and
    # dgrad as one grouped call each, against torch's peers (printed here, no files)
    echo "== GEMM benchmark, any m (limit ${CUGROUPED_GROUPED_BENCH_S:-120} s)"
    timeout --signal=INT --kill-after=20 "${CUGROUPED_GROUPED_BENCH_S:-120}" "$PY" \
        scripts/bench_grouped_any_m.py
    echo "== GEMM benchmark, any m: rc=$?"
} > "$first" 2>&1
cat "$first"
CUGROUPED_GPU_NOTEBOOKS_AFTER_S=0 CUGROUPED_GPU_PROBES_S=0 \
    CUGROUPED_GPU_CHECK_DEADLINE_S="${CUGROUPED_GPU_CHECK_DEADLINE_S:-$((540 - SECONDS))}" \
    bash "$ROOT/scripts/gpu_check.sh" "$OUT"
rc=$?
{ echo; echo "== the grouped check's first stages (before the GPU check above)"; cat "$first"; } \
    >> "$OUT/gpu_check.log"
rm -f "$first"
exit "$rc"
