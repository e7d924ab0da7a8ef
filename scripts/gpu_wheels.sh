#!/usr/bin/env bash
# Wheels for what the lent GPU machine's image lacks (it has no network): the notebook runner
# (nbclient, nbformat, ipykernel) and everything they need, and megatron-core, for its Python
# 3.12 on x86-64 Linux.
# Run here (with network) before a device run; they land in .whl/ (ignored by git), which the
# device call carries (`carry: [".whl"]`). scripts/gpu_check.sh installs, from .whl/, only the
# distributions the image does not already have, into a folder of its own appended to
# PYTHONPATH, so nothing of the image's is shadowed. About 18 MB (the device tool carries 64 MiB
# a call, the checkout included).
# Usage: scripts/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${1:-3.12}"
PY="${PYTHON:-python3}"
rm -rf "$ROOT/.whl"
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
           manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$ROOT/.whl" \
    nbclient nbformat ipykernel 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
# Megatron-core for tests/test_pytorch_megatron.py's GPU test (its MoELayer needs CUDA), without
# its dependencies (torch, numpy, packaging; packaging in case the image lacks it), ~3 MB
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version "$PYVER" --implementation cp "${platforms[@]}" -d "$ROOT/.whl" \
    "megatron-core==0.16.*" packaging 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
if ! compgen -G "$ROOT/.whl/nbclient-*.whl" > /dev/null \
        || ! compgen -G "$ROOT/.whl/megatron_core-*.whl" > /dev/null; then
    echo "gpu_wheels: download failed (above)" >&2
    exit 1
fi
echo "gpu_wheels: $(ls "$ROOT/.whl" | wc -l) wheels, $(du -sh "$ROOT/.whl" | cut -f1) in .whl/" \
     "(carry \".whl\" in the device call)"
