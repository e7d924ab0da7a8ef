"""Command line: ``python -m cugrouped {demo,compile-check,bench,info}``."""

from __future__ import annotations

import argparse
import sys


def _cmd_compile_check(args) -> int:
    from ._compile_check import ARCHS, compile_check

    archs = tuple(a.strip().removeprefix("sm_") for a in args.arch.split(",")) if args.arch else ARCHS
    return compile_check(archs, names=tuple(args.kernel) or None, sass=args.sass)


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(num_experts=args.experts, k=args.k, n=args.n, tokens=args.tokens,
                    device=args.device)


def _cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args.what, out_dir=args.out, quick=args.quick)


def _cmd_info(args) -> int:
    import numpy

    from . import __version__, gpu_available
    from ._jit import registered
    from ._sources import kernels_dir

    print(f"cugrouped {__version__}, numpy {numpy.__version__}")
    print(f"kernel sources: {kernels_dir()}")
    try:
        import cupy

        print(f"cupy {cupy.__version__}; GPU available: {gpu_available()}")
    except ImportError:
        print("cupy: not installed (CPU backends only)")
    from . import ops  # noqa: F401

    for name, spec in registered().items():
        print(f"kernel {name}: {spec.source}, {len(spec.name_expressions)} instantiations")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cugrouped", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="an MoE expert layer's FP8 work on synthetic data")
    d.add_argument("--experts", type=int, default=8)
    d.add_argument("--k", type=int, default=None, help="hidden size (default: 2048 GPU, 512 CPU)")
    d.add_argument("--n", type=int, default=None, help="expert output size (default: 1024 GPU, 256 CPU)")
    d.add_argument("--tokens", type=int, default=None, help="routed tokens (default: 16384 GPU, 1024 CPU)")
    d.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("compile-check", help="NVRTC-compile every kernel for sm_80/89/90/100 (no GPU needed)")
    c.add_argument("--arch", default="", help="comma-separated list, e.g. 90,100 (default: 80,89,90,100)")
    c.add_argument("--kernel", action="append", default=[], help="only this registered kernel (repeatable)")
    c.add_argument("--sass", action="store_true",
                   help="also disassemble (nvdisasm): 16-byte loads/stores, FP8 conversions, local memory")
    c.set_defaults(func=_cmd_compile_check)

    b = sub.add_parser("bench", help="benchmarks against the peers (GPU); host planning cost (CPU)")
    b.add_argument("what", nargs="?", default="all", choices=("cast", "gemm", "layer", "all"))
    b.add_argument("--out", default=None, help="folder for the CSV")
    b.add_argument("--quick", action="store_true", help="short configs (the GPU check uses this)")
    b.set_defaults(func=_cmd_bench)

    i = sub.add_parser("info", help="versions, kernel sources, registered kernels, GPU presence")
    i.set_defaults(func=_cmd_info)

    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
