"""The GEMM benchmark (``python -m cugrouped bench gemm --quick``) with the grouped path's rule
that every group's m, n and k be a multiple of 16 bytes lifted (``GROUPED_DIM_BYTES = 1``), for
a GPU whose cuBLAS has the grouped GEMM: MoE token counts are any m, so under the rule the
benchmark's jagged configs run fprop and dgrad on the loop. Prints the rows (each cugrouped row
says which path ran, ``grouped`` or ``loop``) and writes nothing; run by
scripts/gpu_grouped_check.sh beside the grouped probe, which checks the results of such calls
against the loop's. A measurement, not a setting: the rule stays until a GPU shows cuBLAS right
without it.

    python scripts/bench_grouped_any_m.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from cugrouped.__main__ import main as cli
    from cugrouped.ops import _gemm_grouped

    rule = _gemm_grouped.GROUPED_DIM_BYTES
    _gemm_grouped.GROUPED_DIM_BYTES = 1
    try:
        print(f"bench_grouped_any_m: GROUPED_DIM_BYTES {rule} -> 1 (any m)")
        return cli(["bench", "gemm", "--quick", *(argv if argv is not None else sys.argv[1:])])
    finally:
        _gemm_grouped.GROUPED_DIM_BYTES = rule


if __name__ == "__main__":
    sys.exit(main())
