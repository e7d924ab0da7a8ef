"""cuBLASLt binding: the few entry points cugrouped needs, loaded from the installed libcublasLt.

Layer 5 of design.md §2. ``_lib`` loads the library and declares prototypes, ``_enums`` holds the
header values used, ``descriptors`` wraps the opaque objects and caches them. Everything except
:class:`Handle` (and the heuristic query and the matmul, which need one) works without a GPU.
"""

from ._lib import (CublasLtError, HeuristicResult, MatmulAlgo, check, cudart_version,
                   has_grouped_gemm, lib,
                   library_path, version)
from .descriptors import (GemmConfig, GroupedMatrixLayout, Handle, MatmulDesc, MatmulPreference,
                          MatrixLayout,
                          clear_caches, matmul_desc, matrix_layout, preference)

__all__ = ["check", "has_grouped_gemm", "GroupedMatrixLayout", "CublasLtError", "HeuristicResult", "MatmulAlgo", "lib", "library_path", "version",
           "cudart_version", "GemmConfig", "Handle", "MatmulDesc", "MatmulPreference",
           "MatrixLayout", "matmul_desc", "matrix_layout", "preference", "clear_caches"]
