"""The cuBLAS / cuBLASLt / CUDA enum values cugrouped uses, and nothing else.

Every value was read from the headers of the CUDA 13 toolkit and the ``nvidia-cublas`` 13.x wheel
(``cublasLt.h``, ``cublas_api.h``, ``library_types.h``); ``tests/test_cublaslt.py`` parses the
local headers, when present, and checks each one. These values are ABI: they have not changed
between cuBLAS 11 and 13.
"""

from __future__ import annotations

__all__ = ["STATUS_NAMES", "status_name", "DTYPE_TO_CUDA", "HEADER_VALUES"]

# cublasStatus_t (cublas_api.h)
CUBLAS_STATUS_SUCCESS = 0
CUBLAS_STATUS_NOT_INITIALIZED = 1
CUBLAS_STATUS_ALLOC_FAILED = 3
CUBLAS_STATUS_INVALID_VALUE = 7
CUBLAS_STATUS_ARCH_MISMATCH = 8
CUBLAS_STATUS_MAPPING_ERROR = 11
CUBLAS_STATUS_EXECUTION_FAILED = 13
CUBLAS_STATUS_INTERNAL_ERROR = 14
CUBLAS_STATUS_NOT_SUPPORTED = 15
CUBLAS_STATUS_LICENSE_ERROR = 16

# cublasOperation_t (cublas_api.h)
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1

# cublasComputeType_t (cublas_api.h)
CUBLAS_COMPUTE_32F = 68

# cudaDataType_t (library_types.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
CUDA_R_8F_E4M3 = 28
CUDA_R_8F_E5M2 = 29

# cublasLtPointerMode_t (cublasLt.h; CUBLASLT_POINTER_MODE_HOST = CUBLAS_POINTER_MODE_HOST = 0)
CUBLASLT_POINTER_MODE_HOST = 0

# cublasLtOrder_t
CUBLASLT_ORDER_COL = 0

# cublasLtEpilogue_t
CUBLASLT_EPILOGUE_DEFAULT = 1
CUBLASLT_EPILOGUE_BIAS = 4

# cublasLtMatmulDescAttributes_t
CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0
CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1
CUBLASLT_MATMUL_DESC_POINTER_MODE = 2
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
CUBLASLT_MATMUL_DESC_EPILOGUE = 7
CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8
CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17
CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18
CUBLASLT_MATMUL_DESC_FAST_ACCUM = 25
CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26

# cublasLtMatrixLayoutAttribute_t
CUBLASLT_MATRIX_LAYOUT_TYPE = 0
CUBLASLT_MATRIX_LAYOUT_ORDER = 1
CUBLASLT_MATRIX_LAYOUT_ROWS = 2
CUBLASLT_MATRIX_LAYOUT_COLS = 3
CUBLASLT_MATRIX_LAYOUT_LD = 4
CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5

# cublasLtMatmulPreferenceAttributes_t
CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8

# cublasLtMatmulSearch_t
CUBLASLT_SEARCH_BEST_FIT = 0

# Every constant above, by its header name (the test checks each against the headers).
HEADER_VALUES: dict[str, int] = {k: v for k, v in dict(globals()).items()
                                 if k.startswith(("CUBLAS_", "CUBLASLT_", "CUDA_R_"))}

STATUS_NAMES: dict[int, str] = {v: k for k, v in HEADER_VALUES.items() if k.startswith("CUBLAS_STATUS_")}

# cugrouped dtype names (see cugrouped._array) -> cudaDataType_t
DTYPE_TO_CUDA: dict[str, int] = {
    "float32": CUDA_R_32F, "float16": CUDA_R_16F, "bfloat16": CUDA_R_16BF,
    "float8_e4m3fn": CUDA_R_8F_E4M3, "float8_e5m2": CUDA_R_8F_E5M2,
}


def status_name(status: int) -> str:
    return STATUS_NAMES.get(int(status), "unknown status")
