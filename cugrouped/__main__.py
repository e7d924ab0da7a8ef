"""Command line: ``python -m cugrouped {demo,compile-check,bench,access,info}``."""

from __future__ import annotations

import argparse
import os
import re
import sys


def _cmd_compile_check(args) -> int:
    from ._compile_check import ARCHS, compile_check

    archs = args.arch or ARCHS
    return compile_check(archs, names=tuple(args.kernel) or None, sass=args.sass)


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(num_experts=args.experts, k=args.k, n=args.n, tokens=args.tokens,
                    device=args.device)


def _cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args.what, out_dir=args.out, quick=args.quick)


def _cmd_access(args) -> int:
    from ._access_report import run_access_report

    return run_access_report(args.what, dtype=args.dtype, k=args.k, splits=args.splits)


def _splits(text: str) -> tuple[int, ...]:
    try:
        v = tuple(int(t) for t in text.split(","))
    except ValueError:
        v = ()
    if not v or min(v) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts >= 0, got {text!r}")
    return v


def _cmd_info(args) -> int:
    import numpy

    from . import __version__, gpu_available
    from ._jit import registered
    from ._sources import kernels_dir

    print(f"cugrouped {__version__}, numpy {numpy.__version__}")
    print(f"kernel sources: {kernels_dir()}")
    try:
        import cupy
        from cupy.cuda import nvrtc

        print(f"cupy {cupy.__version__}; NVRTC {'.'.join(map(str, nvrtc.getVersion()))}; "
              f"GPU available: {gpu_available()}")
    except ImportError:
        print("cupy: not installed (CPU backends only)")
    except Exception as exc:                      # CuPy without a loadable NVRTC
        print(f"cupy {cupy.__version__}; NVRTC: not loadable ({type(exc).__name__}: {exc})")
    try:
        from .cublaslt import _lib

        v = _lib.version()
        named = f", named by {_lib.ENV_VAR}" if os.environ.get(_lib.ENV_VAR) else ""
        print(f"cuBLASLt {v // 10000}.{v // 100 % 100}.{v % 100} ({_lib.library_path()}{named})")
        print("cuBLASLt grouped GEMM: " + (
            "exported (one call for all experts on sm_90 from 13.4, FP8 13.5, block scales 13.6; "
            "sm_100+ from 13.3)" if _lib.has_grouped_gemm() else
            "not in this library (the GEMMs take the per-expert loop)"))
    except Exception as exc:                      # no cuBLAS wheel or toolkit
        print(f"cuBLASLt: not loadable ({type(exc).__name__}: {exc}); the GEMMs run on the "
              f"NumPy reference only")
    try:
        import torch

        print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    except ImportError:
        print("torch: not installed (cugrouped.pytorch needs it)")
    from . import ops  # noqa: F401

    for name, spec in registered().items():
        print(f"kernel {name}: {spec.source}, {len(spec.name_expressions)} instantiations")
    return 0


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


MIN_ARCH = 80      # the casts' software FP8 path starts at sm_80 (README, "What runs where")


def _arch_list(text: str) -> tuple[str, ...]:
    """``--arch``: "90,100" or "sm_90,sm_100a" -> ("90", "100a"); sm_80 and newer."""
    archs = tuple(a.strip().removeprefix("sm_") for a in text.split(",") if a.strip())
    for a in archs:
        if not re.fullmatch(r"\d+[af]?", a) or int(a.rstrip("af")) < MIN_ARCH:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated architectures sm_{MIN_ARCH} or newer (e.g. 90,100), "
                f"got {a!r}")
    if not archs:
        raise argparse.ArgumentTypeError("expected at least one architecture, e.g. 90,100")
    return archs


def _multiple_of_16(text: str) -> int:
    v = _positive_int(text)
    if v % 16:
        raise argparse.ArgumentTypeError(f"FP8 GEMMs need a multiple of 16, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cugrouped",
        description="cugrouped: fused FP8 pad + cast + transpose and grouped GEMMs for MoE experts.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="an MoE expert layer's FP8 work on synthetic data")
    d.add_argument("--experts", type=_positive_int, default=8, help="number of experts (default: 8)")
    d.add_argument("--k", type=_multiple_of_16, default=None,
                   help="hidden size, a multiple of 16 (default: 2048 GPU, 512 CPU)")
    d.add_argument("--n", type=_multiple_of_16, default=None,
                   help="expert output size, a multiple of 16 (default: 1024 GPU, 256 CPU)")
    d.add_argument("--tokens", type=_positive_int, default=None,
                   help="routed tokens (default: 16384 GPU, 1024 CPU)")
    d.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("compile-check", help="NVRTC-compile every kernel for sm_80/89/90/100 (no GPU needed)")
    c.add_argument("--arch", type=_arch_list, default=None,
                   help="comma-separated list, e.g. 90,100 (default: 80,89,90,100)")
    c.add_argument("--kernel", action="append", default=[], help="only this registered kernel (repeatable)")
    c.add_argument("--sass", action="store_true",
                   help="also disassemble (nvdisasm): 16-byte loads/stores, FP8 conversions, local memory")
    c.set_defaults(func=_cmd_compile_check)

    b = sub.add_parser("bench", help="benchmarks against the peers (GPU); host planning cost (CPU)")
    b.add_argument("what", nargs="?", default="all", choices=("cast", "gemm", "layer", "all"))
    b.add_argument("--out", default=None,
                   help="folder for the CSV, plots and targets table (without it nothing is written)")
    b.add_argument("--quick", action="store_true", help="short configs (the GPU check uses this)")
    b.set_defaults(func=_cmd_bench)

    a = sub.add_parser("access", help="the cast kernels' memory accesses, emulated on the CPU: "
                                      "sectors per request, bank conflicts, DRAM floor")
    a.add_argument("what", nargs="?", default="all", choices=("cast", "block", "mxfp8", "all"))
    a.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    a.add_argument("--k", type=_multiple_of_16, default=256, help="hidden size (default: 256)")
    a.add_argument("--splits", type=_splits, default=(128, 0, 161, 64),
                   help="rows per expert, comma-separated (default: 128,0,161,64)")
    a.set_defaults(func=_cmd_access)

    i = sub.add_parser("info", help="versions, kernel sources, registered kernels, GPU presence")
    i.set_defaults(func=_cmd_info)

    args = p.parse_args(argv)
    if args.cmd == "compile-check" and args.kernel:
        from . import ops  # noqa: F401  (registers the kernels)
        from ._jit import registered

        unknown = sorted(set(args.kernel) - set(registered()))
        if unknown:
            c.error(f"--kernel: unknown {unknown}; registered kernels: {sorted(registered())}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
