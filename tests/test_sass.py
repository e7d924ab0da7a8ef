"""The cast kernel's machine code, read without a GPU (NVRTC cubin -> nvdisasm).

What must hold in SASS for the kernel to move bytes at full width: the fast path's global loads
and stores are 16 bytes wide (a 64 x 128 tile over 256 threads is 4 loads of 16 bytes each for
16-bit input, 8 for float32, per code path, and 2 + 2 stores of 16 bytes for the row-wise and transposed FP8
tiles); on a full tile all of a thread's loads are issued before any of them is used; the FP8 conversion is the hardware ``F2FP.SATFINITE`` instruction from sm_89 on and the
portable integer path below; nothing spills to local memory; the amax-only pass writes no tile;
the register counts keep the occupancy the launch bounds promise.
"""

from __future__ import annotations

import pytest

from cugrouped import _compile_check, _sass
from cugrouped.grouped_block_fp8 import MX_DIMS
from cugrouped.ops import block_cast_transpose as bct
from cugrouped.ops import pad_cast_transpose as pct

pytestmark = pytest.mark.skipif(_sass.find_nvdisasm() is None,
                                reason="nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")

ARCHS = ("80", "89", "90", "100")
DTYPES = ("float32", "float16", "bfloat16")
FORMATS = ("e4m3", "e5m2")
# (mode, column sums): column sums only in the passes that compute amax
VARIANTS = (("AMAX_ONLY", False), ("AMAX_ONLY", True), ("CAST", False), ("CAST_AMAX", False),
            ("CAST_AMAX", True))


def _compiled(spec, arch):
    """(arch, {name: SASS text}, {name: ptxas resources}) from one compile of ``spec``."""
    image, mapping, log = _compile_check.compile_offline(spec, arch)
    resources = {r.name: r for r in _compile_check.parse_ptxas_log(log, arch, mapping)}
    return arch, _sass.disassemble_image(image, mapping), resources


@pytest.fixture(scope="module", params=ARCHS)
def sass(request):
    """The plain kernels, one compile per architecture."""
    return _compiled(pct.KERNEL_SPEC, request.param)


def test_every_instantiation_is_disassembled(sass):
    arch, by_name, resources = sass
    assert set(by_name) == set(resources) == set(pct.KERNEL_SPEC.name_expressions)
    assert len(by_name) == 30          # 3 dtypes x 2 formats x (3 modes + 2 column-sum variants)


@pytest.mark.parametrize("mode,colsum", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_memory_access_and_hardware_fp8(sass, dtype, fmt, mode, colsum):
    arch, by_name, _ = sass
    ops = _sass.memory_ops(by_name[pct.kernel_name(dtype, fmt, mode, colsum)])
    loads = 8 if dtype == "float32" else 4           # 64 x 128 x itemsize / (256 threads x 16 B)
    # two code paths of 16-byte loads, one copy each (column sums are a template parameter, not a
    # run-time branch that would double them): the full-tile path, `loads` loads issued together,
    # and the per-segment path of the other tiles, loads / 2 in each of its 2 iterations
    assert ops["LDG.E.128"] == 2 * loads, ops
    assert not any(op.startswith(("LDL", "STL")) for op in ops), ops   # no local memory
    cvt = f"F2FP.SATFINITE.{fmt.upper()}.F32.PACK_AB_MERGE_C"
    f2fp = sum(v for op, v in ops.items() if op.startswith("F2FP"))
    if mode == "AMAX_ONLY":
        assert ops["STG.E.128"] == 0 and f2fp == 0, ops   # reads only: no tile written
        return
    # 2 row-wise + 2 transposed per thread (the second one skipped on an expert's last run of 16)
    assert ops["STG.E.128"] == 4, ops
    if int(arch) >= 89:
        # 64 x 128 / 256 threads / 2 per instruction = 16 at the one conversion site that both load
        # paths share (32 would mean it was duplicated); ptxas may recompute one or two for the
        # byte-wise row-wise store (sm_100, float32 CAST_AMAX with column sums: 18)
        assert 16 <= ops[cvt] <= 18, ops
    else:
        assert f2fp == 0, ops                           # sm_80: the portable conversion


@pytest.mark.parametrize("mode,colsum", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_tile_issues_all_loads_before_the_first_use(sass, dtype, fmt, mode, colsum):
    """A full tile's loads (both iterations of a thread) sit in one basic block before any
    instruction that consumes data (FMNMX, FMUL, FADD, F2FP, STS, STG): all 64 B (16-bit input) or
    128 B (float32) per thread are in flight together. Counted per basic block, so it does not
    depend on where ptxas places the full-tile path; the code before this change issued 1-2
    (16-bit) or 4 (float32), one iteration's worth, before converting and storing."""
    arch, by_name, _ = sass
    loads = 8 if dtype == "float32" else 4
    assert _sass.longest_load_run(by_name[pct.kernel_name(dtype, fmt, mode, colsum)]) == loads


@pytest.mark.parametrize("mode,colsum", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_registers_fit_the_launch_bounds(sass, dtype, mode, colsum):
    """__launch_bounds__(256, pct_min_blocks): 4 blocks per SM (<= 64 registers), 6 for the
    amax-only pass without column sums (<= 40; 5, <= 48, for float32 input), 3 for float32
    CAST_AMAX with column sums on sm_80 and sm_100 (<= 80; it spills at 64 there); never a
    spill."""
    arch, _, resources = sass
    for fmt in FORMATS:
        r = resources[pct.kernel_name(dtype, fmt, mode, colsum)]
        cap = {("AMAX_ONLY", False): 48 if dtype == "float32" else 40}.get((mode, colsum), 64)
        if (dtype, mode, colsum) == ("float32", "CAST_AMAX", True) and arch in ("80", "100"):
            cap = 80
        assert r.registers <= cap and r.spills == 0, r


def test_longest_load_run_counts_one_basic_block_before_a_use():
    text = """
        /*0010*/ LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/ @!P0 LDG.E.128 R8, desc[UR4][R2.64+0x10] ;
        /*0030*/ IMAD.U32 R0, R4, 0x10000, RZ ;
        /*0040*/ LDG.E.128 R12, desc[UR4][R6.64] ;
        /*0050*/ FMNMX.FTZ R0, RZ, |R0|, !PT ;
        /*0060*/ LDG.E.128 R16, desc[UR4][R6.64+0x10] ;
        /*0070*/ @P1 BRA `(.L_x_1) ;
        /*0080*/ LDG.E.128 R20, desc[UR4][R6.64+0x20] ;
    .L_x_1:
        /*0090*/ LDG.E.128 R24, desc[UR4][R6.64+0x30] ;
    """
    assert _sass.longest_load_run(text) == 3


def test_memory_ops_counts_full_opcodes():
    text = """
        /*0010*/ LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/ @P0 STG.E.U8 desc[UR4][R6.64], R9 ;
        /*0030*/ F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R0, R1, R2, RZ ;
        /*0040*/ LDG.E.128 R8, desc[UR4][R2.64+0x10] ;
        /*0050*/ FMNMX R0, R1, R2, !PT ;
    """
    assert _sass.memory_ops(text) == {"LDG.E.128": 2, "STG.E.U8": 1,
                                      "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C": 1}


@pytest.fixture(scope="module", params=ARCHS)
def gather_sass(request):
    """The gather kernels (row_index), one compile per architecture."""
    return _compiled(pct.GATHER_KERNEL_SPEC, request.param)


@pytest.mark.parametrize("mode,colsum", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_keeps_wide_loads_issued_together(gather_sass, dtype, mode, colsum):
    """The gather variants (row_index, a module of their own): the same 16-byte loads, a full
    tile's all issued before any is used (the row index is a select, not a branch), no local
    memory, and the registers of their launch bounds (one step below the plain kernels')."""
    arch, by_name, resources = gather_sass
    loads = 8 if dtype == "float32" else 4
    for fmt in FORMATS:
        name = pct.kernel_name(dtype, fmt, mode, colsum, gather=True)
        ops = _sass.memory_ops(by_name[name])
        assert ops["LDG.E.128"] == 2 * loads, ops
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        assert _sass.longest_load_run(by_name[name]) == loads
        cap = 48 if (mode, colsum) == ("AMAX_ONLY", False) else \
            (128 if mode == "CAST_AMAX" else 80) if (dtype, colsum) == ("float32", True) else \
            80 if (dtype, mode) == ("float32", "CAST") else 64
        assert resources[name].registers <= cap and resources[name].spills == 0, resources[name]


@pytest.fixture(scope="module", params=ARCHS)
def act_sass(request):
    """The activation kernels (swiglu before the cast, a module of their own)."""
    return _compiled(pct.ACT_KERNEL_SPEC, request.param)


@pytest.mark.parametrize("mode", ["AMAX_ONLY", "CAST", "CAST_AMAX"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_loads_both_halves_together_without_spilling(act_sass, dtype, mode):
    """The swiglu variants read both halves [a | b] with 16-byte loads, a full tile's all
    issued before any is used (twice the plain kernel's), convert with the hardware F2FP from
    sm_89 on, keep off local memory within their launch bounds (80 registers, float32 128), and
    compute exp themselves (no MUFU.EX2: the hardware's approximation has no CPU twin)."""
    arch, by_name, resources = act_sass
    loads = 8 if dtype == "float32" else 4
    for fmt in FORMATS:
        name = pct.kernel_name(dtype, fmt, mode, activation="swiglu")
        text = by_name[name]
        ops = _sass.memory_ops(text)
        assert ops["LDG.E.128"] == 4 * loads, ops      # (a, b) x (full tile, other tiles)
        assert _sass.longest_load_run(text) == 2 * loads
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        assert "MUFU.EX2" not in text
        cap = 128 if dtype == "float32" else 80
        assert resources[name].registers <= cap and resources[name].spills == 0, resources[name]
        f2fp = ops.get(f"F2FP.SATFINITE.{fmt.upper()}.F32.PACK_AB_MERGE_C", 0)
        if mode != "AMAX_ONLY" and int(arch) >= 89:
            assert 16 <= f2fp <= 18, ops
        else:
            assert f2fp == 0, ops


# ------------------------------------------------------------------------------------------------
# The block-scaled cast (kernels_cu/block_cast_transpose.cu): 128 x 128 tiles, 4 segments a thread.

@pytest.fixture(scope="module", params=ARCHS)
def block_sass(request):
    """The block cast's module as compile-check compiles it (read back from its disk cache)."""
    return _compiled(bct.KERNEL_SPEC, request.param)


@pytest.mark.parametrize("dims", [1, 2, MX_DIMS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_cast_wide_access_loads_together_and_hardware_fp8(block_sass, dtype, dims):
    """16-byte loads, a full tile's 16 (float32) or 8 (16-bit) of them in one basic block before
    any use (and as many again on the bounds-checked path); 4 row-wise + 4 transposed 16-byte
    stores; 32 + 32 conversions of two elements on sm_89+ (the row-wise and the column-wise
    bytes have scales of their own), none below -- ptxas may recompute a few under the 80-register
    cap of 2-D blocks of 16-bit input (bfloat16 2-D: 76 on sm_90, 74 on sm_100, NVRTC 13.0; a
    duplicated conversion path would be 128); no local memory; the registers of the launch
    bounds (128: 2 blocks an SM; 80 for 2-D blocks of 16-bit input). MXFP8 (MX_DIMS) the same,
    plus one 16-byte store of its E8M0 scale tiles."""
    arch, by_name, resources = block_sass
    loads = 16 if dtype == "float32" else 8
    for fmt in FORMATS:
        name = bct.kernel_name(dtype, fmt, dims)
        ops = _sass.memory_ops(by_name[name])
        assert ops["LDG.E.128"] == 2 * loads, ops
        assert _sass.longest_load_run(by_name[name]) == loads
        # (+1 for MXFP8: its E8M0 scale tiles, staged in shared memory, 16 bytes per lane)
        assert ops["STG.E.128"] == 8 + (dims == MX_DIMS), ops
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        f2fp = sum(v for op, v in ops.items() if op.startswith("F2FP"))
        if int(arch) < 89:
            assert f2fp == 0, ops
        else:
            cvt = ops[f"F2FP.SATFINITE.{fmt.upper()}.F32.PACK_AB_MERGE_C"]
            assert cvt == f2fp and (cvt == 64 or (dims == 2 and dtype != "float32" and cvt <= 80)), ops
        cap = 80 if dims == 2 and dtype != "float32" else 128
        assert resources[name].registers <= cap and resources[name].spills == 0, resources[name]


@pytest.fixture(scope="module", params=ARCHS)
def block_gather_sass(request):
    return _compiled(bct.GATHER_KERNEL_SPEC, request.param)


@pytest.mark.parametrize("dims", [1, 2, MX_DIMS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_cast_gather_keeps_wide_loads_issued_together(block_gather_sass, dtype, dims):
    """The gather variants of the block cast (row_index): the row address is a select, so a full
    tile's 16-byte loads still sit in one basic block; no local memory; the same launch bounds."""
    arch, by_name, resources = block_gather_sass
    loads = 16 if dtype == "float32" else 8
    for fmt in FORMATS:
        name = bct.kernel_name(dtype, fmt, dims, gather=True)
        ops = _sass.memory_ops(by_name[name])
        assert ops["LDG.E.128"] == 2 * loads, ops
        assert _sass.longest_load_run(by_name[name]) == loads
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        cap = 80 if dims == 2 and dtype != "float32" else 128
        assert resources[name].registers <= cap and resources[name].spills == 0, resources[name]


@pytest.fixture(scope="module", params=ARCHS)
def block_act_sass(request):
    return _compiled(bct.ACT_KERNEL_SPEC, request.param)


@pytest.mark.parametrize("dims", [1, MX_DIMS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_cast_swiglu_loads_whole_words_without_spilling(block_act_sass, dtype, dims):
    """The swiglu variants of the block casts: both halves [a | b] read with 16-byte loads (one
    iteration's two segments at a time: the tile is the activation's float32 values from then
    on), the float32 tile's 64 + 64 hardware conversions on sm_89+, no local memory within 128
    registers, and no MUFU.EX2 (the activation's exp has no hardware approximation)."""
    arch, by_name, resources = block_act_sass
    loads = 4 if dtype == "float32" else 2           # per half and iteration: 16 elements
    for fmt in FORMATS:
        name = bct.kernel_name(dtype, fmt, dims, activation="swiglu")
        text = by_name[name]
        ops = _sass.memory_ops(text)
        assert ops["LDG.E.128"] == 4 * 2 * loads, ops        # 4 iterations x 2 halves
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        assert "MUFU.EX2" not in text
        f2fp = sum(v for op, v in ops.items() if op.startswith("F2FP"))
        assert f2fp == (64 if int(arch) >= 89 else 0), ops
        assert resources[name].registers <= 128 and resources[name].spills == 0, resources[name]


@pytest.mark.parametrize("arch", ARCHS)
def test_scatter_rows_reads_and_writes_whole_words(arch):
    """The MoE unpermute's sum: a thread's 4 columns of a row in one read-only (``.CONSTANT``)
    load, 16 bytes of float32 or 8 of 16-bit values, and its 4 sums in one 16-byte store (NVVM
    split the plain float4 store into four on sm_80..sm_90: the kernel states it in PTX)."""
    from cugrouped.ops import scatter_rows as sr

    _, by_name, resources = _compiled(sr.KERNEL_SPEC, arch)
    for dtype in ("float32", "float16", "bfloat16"):
        name = sr.kernel_name(dtype)
        ops = _sass.memory_ops(by_name[name])
        word = "LDG.E.128.CONSTANT" if dtype == "float32" else "LDG.E.64.CONSTANT"
        assert ops[word] >= 1 and ops["STG.E.128"] == 1, (dtype, ops)
        assert not any(op.startswith(("LDL", "STL")) for op in ops), (dtype, ops)
        assert resources[name].spill_stores == resources[name].spill_loads == 0


@pytest.fixture(scope="module", params=ARCHS)
def sass_tpb2(request):
    """The two-tiles-per-block kernels (set_tiles_per_block(2)), one compile per architecture."""
    return _compiled(pct.TPB_KERNEL_SPEC, request.param)


@pytest.mark.parametrize("mode", ["AMAX_ONLY", "CAST", "CAST_AMAX"])
@pytest.mark.parametrize("dtype", pct.TPB_DTYPES)
def test_two_tiles_per_block_keep_the_full_tile_loads_and_the_bounds(sass_tpb2, dtype, mode):
    """Each of a block's two tiles is the one-tile kernel's body (unrolled twice): a full tile's
    4 loads issued together, 16-byte stores and the hardware conversion twice over, no local
    memory; 64 registers (48 for the amax-only pass, 5 blocks per SM), no spill."""
    arch, by_name, resources = sass_tpb2
    for fmt in FORMATS:
        name = pct.kernel_name(dtype, fmt, mode, tpb=2)
        ops = _sass.memory_ops(by_name[name])
        assert _sass.longest_load_run(by_name[name]) == 4
        assert ops["LDG.E.128"] == 2 * 2 * 4, ops
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        assert ops["STG.E.128"] == (0 if mode == "AMAX_ONLY" else 2 * 4), ops
        if mode != "AMAX_ONLY" and int(arch) >= 89:
            assert 32 <= ops[f"F2FP.SATFINITE.{fmt.upper()}.F32.PACK_AB_MERGE_C"] <= 36, ops
        r = resources[name]
        assert r.registers <= (48 if mode == "AMAX_ONLY" else 64) and r.spills == 0, r


@pytest.fixture(scope="module", params=ARCHS)
def sass_half(request):
    """The half-tile kernels (set_half_tiles(True)), one compile per architecture."""
    return _compiled(pct.HALF_KERNEL_SPEC, request.param)


@pytest.mark.parametrize("mode", ["AMAX_ONLY", "CAST", "CAST_AMAX"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_half_tiles_keep_the_full_tile_loads_and_the_bounds(sass_half, dtype, mode):
    """A half tile is a full tile's work at other addresses: the plain kernel's loads, all of
    a full tile's issued together, its 16-byte stores and hardware conversions, no local
    memory; within pct_half_min_blocks' registers (64; 48 for the 16-bit amax-only pass, 5
    blocks per SM; 80 for float32 CAST, 3), no spill."""
    arch, by_name, resources = sass_half
    loads = 8 if dtype == "float32" else 4
    for fmt in FORMATS:
        name = pct.kernel_name(dtype, fmt, mode, half=True)
        ops = _sass.memory_ops(by_name[name])
        assert _sass.longest_load_run(by_name[name]) == loads
        assert ops["LDG.E.128"] == 2 * loads, ops
        assert not any(op.startswith(("LDL", "STL")) for op in ops), ops
        assert ops["STG.E.128"] == (0 if mode == "AMAX_ONLY" else 4), ops
        if mode != "AMAX_ONLY" and int(arch) >= 89:
            assert 16 <= ops[f"F2FP.SATFINITE.{fmt.upper()}.F32.PACK_AB_MERGE_C"] <= 18, ops
        r = resources[name]
        cap = 48 if mode == "AMAX_ONLY" and dtype != "float32" else \
            80 if (dtype, mode) == ("float32", "CAST") else 64
        assert r.registers <= cap and r.spills == 0, r
