"""Setup kernel of the grouped GEMM: the CUDA source run on the CPU emulator must write the NumPy
reference's bytes into the workspace over the split taxonomy (design.md §6), with host counts and
with device counts (clamped like the cast kernel's), with dropped experts, in several fiber
orders; the NVRTC compile for every architecture without spills; the specs the op builds for each
pass match the per-expert loop's plan; and (``gpu``) the same bytes on a device."""

from __future__ import annotations

import numpy as np
import pytest

from cugrouped.ops import _launch
from cugrouped.ops import grouped_gemm as gg
from cugrouped.ops import grouped_gemm_setup as gs
from cugrouped.reference import grouped_gemm_setup as ref

SPLITS = {
    "uniform": [32, 32, 32, 32],
    "skewed": [3, 130, 1, 70],
    "empty_first": [0, 33, 17],
    "empty_middle": [20, 0, 45],
    "empty_last": [29, 64, 0],
    "single": [77],
    "not_mult16": [17, 5, 31, 9],
    "count_one": [1, 1, 2],
    "many": [int(v) for v in np.random.default_rng(0).integers(0, 300, gs.MAX_GROUPS)],
}
T = gs.TOKENS


# Scale pointers: per-tensor (one float32 per expert), or block scales as the grouped GEMM's
# block-scaled passes give them (A a weight's: a constant size per expert; B an activation's:
# a size that grows with q(tokens) = roundup(ceil(t / div), mult)).
SCALES = {
    "per_tensor": (0x7F3000000000, 0x7F3000001000),
    "none": (0, 0),
    "vec128_rows": (gs.ScaleSpec(0x7F3000000000, 4 * 16, 0), gs.ScaleSpec(0x7F4000000000, 0, 4 * 3, 1, 4)),
    "vec128_cols": (gs.ScaleSpec(0x7F3000000000, 0, 4 * 64, 128, 1),
                    gs.ScaleSpec(0x7F4000000000, 0, 4 * 48, 128, 1)),
    "mx_cols": (gs.ScaleSpec(0x7F3000000000, 512, 0), gs.ScaleSpec(0x7F4000000000, 0, 128, 32, 4)),
    "blk_cols": (gs.ScaleSpec(0x7F3000000000, 0, 4 * 2, 128, 4), gs.ScaleSpec(0, 0, 0)),
}


def _spec(E, token_align=1, slots=None, beta=0.0, scales="per_tensor"):
    # fake device addresses: the kernel only computes them
    a = gs.MatrixSpec(0x7F0000000000, 2048 * 64, 0, 64, 2048, 64)
    b = gs.MatrixSpec(0x7F1000000000, 0, 64, 64, T, 64)
    d = gs.MatrixSpec(0x7F2000000010, 0, 2 * 2048, 2048, T, 2048)
    if token_align > 1:   # wgrad-like: reduction over the padded tokens, strided outputs
        a = gs.MatrixSpec(0x7F0000000000, 0, 64, T, 64, T)
        b = gs.MatrixSpec(0x7F1000000000, 0, 48, T, 48, T)
        d = gs.MatrixSpec(0x7F2000000000, 4 * 64 * 48, 0, 64, 48, 64)
    return gs.SetupSpec(a, b, d, E, token_align, SCALES[scales], 1.0, beta, slots)


def _workspace(spec):
    _, nbytes = gg.grouped_workspace_layout(spec.groups)
    buf = np.full(nbytes + 32, 0xAB, np.uint8)
    off = (-buf.ctypes.data) % 16
    return buf[off:off + nbytes]


def _run(backend, spec, order="forward", **counts):
    ws = _workspace(spec)
    with _launch.emulation_order(order):
        gs.grouped_gemm_setup(spec, ws, backend=backend, **counts)
    return ws


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("token_align", [1, 16])
@pytest.mark.parametrize("scales", SCALES)
def test_emulated_matches_reference_host_counts(split, token_align, scales):
    m = SPLITS[split]
    spec = _spec(len(m), token_align, scales=scales)
    want = _run("reference", spec, m_host=m)
    for order in ("forward", "reverse", 7, "warps", "warps-reverse"):
        got = _run("emulate", spec, order, m_host=m)
        assert np.array_equal(got, want), (split, order)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("scales", ["per_tensor", "vec128_rows", "mx_cols"])
def test_emulated_matches_reference_device_counts(split, scales):
    m = np.array(SPLITS[split], np.int64)
    spec = _spec(len(m), 16, beta=1.0, scales=scales)
    for dev, total in ((m, int(m.sum())),                      # exact
                       (np.where(m > 2, m + 5, -3), int(m.sum())),   # clamped and negatives
                       (m, max(int(m.sum()) // 2, 0))):         # total cuts the tail
        dev = np.ascontiguousarray(dev, np.int64)
        want = _run("reference", spec, m_dev=dev, total_rows=total)
        got = _run("emulate", spec, "shuffle", m_dev=dev, total_rows=total)
        assert np.array_equal(got, want), split
        # device counts clamp exactly as the reference's host view of them
        host = ref.clamp_counts(dev, total)
        assert np.array_equal(_run("reference", spec, m_host=host), want)


def test_dropped_experts_are_compacted():
    m = [16, 0, 32, 0, 48]
    slots = (0, -1, 1, -1, 2)
    spec = _spec(5, 16, slots)
    want = _run("reference", spec, m_host=m)
    assert np.array_equal(_run("emulate", spec, m_host=m), want)
    arrays = ref.setup_arrays(spec, m)
    assert arrays["a_rows"].tolist() == [16, 32, 48]          # reduction = padded tokens
    assert arrays["d"].tolist() == [0x7F2000000000 + e * 4 * 64 * 48 for e in (0, 2, 4)]
    assert arrays["b"].tolist() == [0x7F1000000000 + 48 * p for p in (0, 16, 48)]


def test_alpha_and_beta_are_written_when_the_first_expert_is_dropped():
    """The scalars belong to the call, not to expert 0: written even when expert 0 has no
    group (the host drops an empty first expert), else the GEMM reads the workspace's old bytes
    as alpha and beta."""
    m = [0, 16, 32]
    spec = _spec(3, 16, (-1, 0, 1), beta=1.0)
    want = _run("reference", spec, m_host=m)
    off, _ = gg.grouped_workspace_layout(spec.groups)
    assert want[off["alpha"]:off["alpha"] + 4].view(np.float32)[0] == 1.0
    assert want[off["beta"]:off["beta"] + 4].view(np.float32)[0] == 1.0
    for order in ("forward", "reverse"):
        assert np.array_equal(_run("emulate", spec, order, m_host=m), want), order


def test_negative_device_counts_count_as_zero():
    """A negative device count is 0 rows and takes no rows from the experts after it: with
    token_align 1 the expert cut by total_rows gets total_rows - (the counts before it), not
    4 rows more, and the negative expert's own tokens are 0, not -4."""
    dev = np.array([-4, 10, 3], np.int64)
    spec = _spec(3, 1, scales="vec128_rows")
    want = _run("reference", spec, m_dev=dev, total_rows=8)
    assert ref.clamp_counts(dev, 8).tolist() == [0, 8, 0]
    assert np.array_equal(_run("reference", spec, m_host=[0, 8, 0]), want)
    for order in ("forward", "shuffle"):
        assert np.array_equal(_run("emulate", spec, order, m_dev=dev, total_rows=8), want), order


def test_pointer_offsets_past_2_31_bytes():
    """Experts that start 4 GiB and more past a base (D's 4096 bytes per token times 2^20
    tokens; block scales of 4096 bytes per token): offsets computed in 32 bits would wrap to
    the first expert's pointer. Only addresses are computed, so the counts cost nothing."""
    m = [2**20, 2**20, 3]
    big = gs.ScaleSpec(0x7F3000000000, 0, 4096, 1, 1)
    s3 = _spec(3)
    spec = gs.SetupSpec(s3.a, s3.b, s3.d, 3, 1, (big, big), 1.0, 0.0)
    arrays = ref.setup_arrays(spec, m)
    starts = (0, 2**20, 2**21)
    assert arrays["d"].tolist() == [0x7F2000000010 + 4096 * p for p in starts]
    assert arrays["a_scale"].tolist() == [0x7F3000000000 + 4096 * p for p in starts]
    want = _run("reference", spec, m_host=m)
    assert np.array_equal(_run("emulate", spec, m_host=m), want)
    dev = np.array(m, np.int64)
    assert np.array_equal(_run("emulate", spec, m_dev=dev, total_rows=sum(m)), want)


def test_reference_layout_and_values():
    m = [3, 0, 20]
    spec = _spec(3)
    ws = _run("reference", spec, m_host=m)
    off, _ = gg.grouped_workspace_layout(3)
    rd = lambda name, dt, n: np.frombuffer(ws[off[name]:off[name] + n * np.dtype(dt).itemsize], dt)  # noqa: E731
    assert rd("b", np.uint64, 3).tolist() == [0x7F1000000000 + 64 * p for p in (0, 3, 3)]
    assert rd("a", np.uint64, 3).tolist() == [0x7F0000000000 + e * 2048 * 64 for e in range(3)]
    assert np.array_equal(rd("c", np.uint64, 3), rd("d", np.uint64, 3))
    assert rd("b_cols", np.int32, 3).tolist() == [3, 0, 20]
    assert rd("d_ld", np.int32, 3).tolist() == [2048] * 3
    assert rd("a_scale", np.uint64, 3).tolist() == [0x7F3000000000 + 4 * e for e in range(3)]
    assert rd("alpha", np.float32, 1)[0] == 1.0 and rd("beta", np.float32, 1)[0] == 0.0


def test_block_scale_pointers_by_hand():
    """q(t) = roundup(ceil(t / div), mult) per expert, its exclusive prefix times the token
    stride, plus the group stride per expert index; no base: null pointers."""
    m = [3, 0, 130, 5]
    ws = _run("reference", _spec(4, 16, scales="mx_cols"), m_host=m)      # tokens 16, 0, 144, 16
    off, _ = gg.grouped_workspace_layout(4)
    rd = lambda name: np.frombuffer(ws[off[name]:off[name] + 32], np.uint64).tolist()  # noqa: E731
    assert rd("a_scale") == [0x7F3000000000 + 512 * e for e in range(4)]
    # q = roundup(ceil(t / 32), 4): 4, 0, 8, 4 -> prefix 0, 4, 4, 12
    assert rd("b_scale") == [0x7F4000000000 + 128 * p for p in (0, 4, 4, 12)]
    ws = _run("reference", _spec(4, 1, scales="vec128_rows"), m_host=m)   # tokens 3, 0, 130, 5
    # q = roundup(t, 4): 4, 0, 132, 8 -> prefix 0, 4, 4, 136
    assert rd("b_scale") == [0x7F4000000000 + 12 * p for p in (0, 4, 4, 136)]
    ws = _run("reference", _spec(4, 16, scales="blk_cols"), m_host=m)
    # q = roundup(ceil(t / 128), 4): 4, 0, 4, 4 -> prefix 0, 4, 4, 8
    assert rd("a_scale") == [0x7F3000000000 + 8 * p for p in (0, 4, 4, 8)]
    assert rd("b_scale") == [0] * 4


def test_struct_layout_and_bad_arguments():
    assert gs.args_dtype().itemsize == 1832          # sizeof(cg::GgsArgs), see the kernel header
    assert gs.args_dtype().fields["m_host"][1] == 292         # offsetof(GgsArgs, m_host)
    with pytest.raises(ValueError, match="div, mult"):
        gs.ScaleSpec(1, 0, 4, 0, 1)
    s3 = _spec(3)
    with pytest.raises(ValueError, match="scales"):
        gs.SetupSpec(s3.a, s3.b, s3.d, 3, 1, (0,))
    with pytest.raises(ValueError, match="num_experts"):
        _spec(gs.MAX_GROUPS + 1)
    with pytest.raises(ValueError, match="slots"):
        _spec(3, slots=(0, 2, -1))
    spec = _spec(3)
    with pytest.raises(ValueError, match="exactly one"):
        gs.pack_args(spec, 0, gg.grouped_workspace_layout(3)[0])
    with pytest.raises(ValueError, match="workspace: expected"):
        gs.grouped_gemm_setup(spec, np.zeros(8, np.uint8), m_host=[1, 2, 3], backend="reference")
    with pytest.raises(ValueError, match="m_dev"):
        gs.grouped_gemm_setup(spec, _workspace(spec), m_dev=np.zeros(3, np.int32), backend="reference")


def test_what_the_kernel_cannot_hold_is_refused_just_past_each_limit():
    """The kernel holds the counts and their sum in int32, reads one count per expert and writes
    16-byte aligned pointer arrays: negative counts, sums of 2^31, a count array of another
    length, token_align 0 and an 8-byte aligned workspace are refused; the values just inside
    each limit are not."""
    spec = _spec(3)
    off = gg.grouped_workspace_layout(3)[0]
    assert gs.pack_args(spec, 0, off, m_host=[2**31 - 2, 1, 0])["m_host"][0] == 2**31 - 2
    for bad in ([2**31 - 1, 1, 0], [5, -1, 3]):
        with pytest.raises(ValueError, match="^m_host: expected 3 non-negative counts"):
            gs.pack_args(spec, 0, off, m_host=bad)
    assert gs.pack_args(spec, 0, off, m_dev_ptr=0x1000, total_rows=2**31 - 1)["total_rows"] \
        == 2**31 - 1
    with pytest.raises(ValueError, match="^total_rows: expected 0 <= total_rows < 2"):
        gs.pack_args(spec, 0, off, m_dev_ptr=0x1000, total_rows=2**31)
    with pytest.raises(ValueError, match=r"^m_dev: expected a contiguous int64 array of shape"):
        gs.grouped_gemm_setup(spec, _workspace(spec), m_dev=np.zeros(4, np.int64),
                              backend="reference")
    with pytest.raises(ValueError, match="^token_align: expected >= 1, got 0"):
        _spec(3, token_align=0)
    nbytes = _workspace(spec).size
    buf = np.zeros(nbytes + 32, np.uint8)
    at8 = ((-buf.ctypes.data) % 16 + 8) % 16               # 8 but not 16-byte aligned
    with pytest.raises(ValueError, match="is not 16-byte aligned"):
        gs.grouped_gemm_setup(spec, buf[at8:at8 + nbytes], m_host=[1, 2, 3], backend="reference")


def test_registered_for_compile_check():
    from cugrouped import _jit

    assert _jit.registered()["grouped_gemm_setup"] is gs.KERNEL_SPEC


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["uniform", "skewed", "empty_first", "many"])
@pytest.mark.parametrize("scales", ["per_tensor", "vec128_rows", "mx_cols"])
def test_gpu_matches_reference(split, scales):
    import cupy

    m = np.array(SPLITS[split], np.int64)
    spec = _spec(len(m), 16, beta=1.0, scales=scales)
    want = _run("reference", spec, m_host=m)
    _, nbytes = gg.grouped_workspace_layout(spec.groups)
    for counts in (dict(m_host=m.tolist()), dict(m_dev=cupy.asarray(m), total_rows=int(m.sum()))):
        ws = cupy.full(nbytes, 0xAB, cupy.uint8)
        gs.grouped_gemm_setup(spec, ws, backend="cuda", **counts)
        assert np.array_equal(cupy.asnumpy(ws), want)
