#!/usr/bin/env bash
# The GPU check again, with a newer libcublasLt carried in parts (scripts/cublas_parts.py): its
# grouped GEMM runs where the image's cuBLAS 13.1 has none. Joins the parts stashed by earlier
# device calls, checks the library's SHA-256, points CUGROUPED_CUBLASLT at it, and runs
# scripts/gpu_check.sh without the notebooks (the plain check runs them) and with a longer
# limit for the GEMM probes (their fourth, the grouped GEMM against the loop, runs here).
# Usage: scripts/gpu_grouped_check.sh OUT_DIR    (OUT_DIR: as scripts/gpu_check.sh's)
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
export CUGROUPED_CUBLASLT="$lib"
echo "gpu_grouped_check: CUGROUPED_CUBLASLT=$lib"
CUGROUPED_GPU_NOTEBOOKS_AFTER_S=0 CUGROUPED_GPU_PROBES_S="${CUGROUPED_GPU_PROBES_S:-150}" \
    exec bash "$ROOT/scripts/gpu_check.sh" "$OUT"
