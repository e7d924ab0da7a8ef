# Sourced by scripts/test.sh and scripts/demo.sh: make (once) and activate .venv with cugrouped
# installed in editable mode plus CuPy and the NVRTC wheel (no GPU needed for either).
# CUGROUPED_VENV overrides the location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CUGROUPED_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[cugrouped] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.cugrouped-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] \
        || [ "$ROOT/scripts/_venv.sh" -nt "$stamp" ]; then
    echo "[cugrouped] installing cugrouped[cuda13,test] into $VENV" >&2
    python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    python -m pip install -q --disable-pip-version-check -e "$ROOT[cuda13,test]" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    # PyTorch for cugrouped.pytorch and its tests: the CPU build 2.13.0 (on this project's machines
    # it is a local file that pip picks up; anything newer would pull a multi-GB CUDA build).
    python -c "import torch" 2>/dev/null || python -m pip install -q --disable-pip-version-check \
        "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    # Megatron-core for tests/test_pytorch_megatron.py (cugrouped.pytorch.megatron), without its
    # dependencies: they are torch, numpy and packaging, all here; pip would resolve torch anew
    python -m pip install -q --disable-pip-version-check --no-deps "megatron-core==0.16.*" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    python -c "import cugrouped, cupy, ml_dtypes, pytest, torch, megatron.core" \
        || { echo "[cugrouped] install failed" >&2; exit 1; }
    touch "$stamp"
fi
cd "$ROOT"
