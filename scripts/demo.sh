#!/usr/bin/env bash
# The main job (README): set up .venv if needed, then run an MoE expert layer's worth of FP8 work on
# synthetic data: on the GPU when there is one, otherwise on the CPU (NumPy reference and the CUDA
# kernels run by the CPU emulator). Extra arguments go to `python -m cugrouped demo`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
python -m cugrouped demo "$@"
