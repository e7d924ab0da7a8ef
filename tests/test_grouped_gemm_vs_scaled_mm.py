"""Issue #5's accuracy rule: on the same FP8 operands, the grouped GEMMs' error (against the exact
product of the dequantized operands, in float64) is at most twice that of a per-expert
``torch._scaled_mm`` loop, for fprop, dgrad and wgrad. On the CPU (torch CPU tensors: the NumPy
reference path against torch's CPU ``_scaled_mm``) and, marked ``gpu``, on CUDA (cuBLASLt against
torch's cuBLAS ``_scaled_mm``).

The rule is on RMS errors over each whole output: a max would hinge on single rounding ties. A
zero baseline error (exact products) allows one bf16 half-ulp of the largest output."""

from __future__ import annotations

import numpy as np
import pytest

import cugrouped

torch = pytest.importorskip("torch")

M_SPLITS, K, N = [64, 0, 33, 128], 128, 96
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def operands(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(M_SPLITS), K, generator=g).bfloat16().to(device)
    dy = torch.randn(sum(M_SPLITS), N, generator=g).bfloat16().to(device)
    w = [(torch.randn(N, K, generator=g) * 0.05).bfloat16().to(device) for _ in M_SPLITS]
    X = cugrouped.multi_pad_cast_transpose(x, M_SPLITS)
    W = cugrouped.multi_pad_cast_transpose(w, align=1)
    DY = cugrouped.multi_pad_cast_transpose(dy, M_SPLITS, fp8_format="e5m2")
    return X, W, DY


def f8(t, fmt):
    return t.view(torch.uint8).view(F8[fmt])


def deq(t, fmt, si):
    return f8(t, fmt).double() * si.double()


def scaled_mm(a, fa, sa, b_colmajor, fb, sb, out_dtype):
    # scales cloned: element i of an (E,) scale_inv is not 16-byte aligned, and cuBLASLt refuses
    # such a scale pointer (torch passes it as it is)
    return torch._scaled_mm(f8(a, fa), f8(b_colmajor, fb), scale_a=sa.float().clone(),
                            scale_b=sb.float().clone(), out_dtype=out_dtype)


def rms(e):
    return e.double().square().mean().sqrt().item() if e.numel() else 0.0


def check(ours, theirs, exact, label):
    eo, et = rms(ours.double() - exact), rms(theirs.double() - exact)
    floor = 2.0 ** -9 * exact.abs().max().item() if exact.numel() else 0.0
    assert eo <= 2 * et + (floor if et == 0 else 0.0), f"{label}: ours {eo:.3g}, _scaled_mm {et:.3g}"
    return eo, et


def run_rule(device):
    X, W, DY = operands(device)
    y = cugrouped.grouped_fprop(X, W)                 # bf16
    dx = cugrouped.grouped_dgrad(DY, W)               # bf16
    dw = cugrouped.grouped_wgrad(X, DY)               # fp32 (E, n, k)
    rows = np.cumsum([0] + M_SPLITS)
    ys, dxs, exact_y, exact_dx = [], [], [], []
    for i, m in enumerate(M_SPLITS):
        sx, sw, sd = X.scale_inv[i], W.scale_inv[i], DY.scale_inv[i]
        xr, wr, dr = X.rowwise(i), W.rowwise(i), DY.rowwise(i)
        if m:
            ys.append(scaled_mm(xr, "e4m3", sx, wr.t(), "e4m3", sw, torch.bfloat16))
            dxs.append(scaled_mm(dr, "e5m2", sd, W.columnwise(i).t(), "e4m3", sw, torch.bfloat16))
        else:
            ys.append(torch.empty(0, N, dtype=torch.bfloat16, device=device))
            dxs.append(torch.empty(0, K, dtype=torch.bfloat16, device=device))
        exact_y.append(deq(xr, "e4m3", sx) @ deq(wr, "e4m3", sw).t())
        exact_dx.append(deq(dr, "e5m2", sd) @ deq(wr, "e4m3", sw))
        # wgrad: dy^T (n, m_pad) row-major times x (m_pad, k) column-major, the padding zeros
        dwt = scaled_mm(DY.columnwise(i), "e5m2", sd, X.columnwise(i).t(), "e4m3", sx,
                        torch.float32) if X.host_splits()[1][i] else \
            torch.zeros(N, K, dtype=torch.float32, device=device)
        ex = deq(DY.columnwise(i), "e5m2", sd) @ deq(X.columnwise(i), "e4m3", sx).t()
        check(dw[i], dwt, ex, f"wgrad expert {i}")
        assert rows[i + 1] - rows[i] == m
    check(y, torch.cat(ys), torch.cat(exact_y), "fprop")
    check(dx, torch.cat(dxs), torch.cat(exact_dx), "dgrad")


def test_error_at_most_twice_a_scaled_mm_loop_cpu():
    run_rule("cpu")


@pytest.mark.gpu
def test_gpu_error_at_most_twice_a_scaled_mm_loop():
    run_rule("cuda")
