"""Triton kernels for the small per-token ops between the GEMMs: RMSNorm with the residual add, and SiLU-and-mul.

Written as torch ops, one pre-norm with its residual add launches about eight kernels (add, widen, square, mean,
rsqrt, two multiplies, narrow), and the gated activation three. A Llama-3-8B step ran ~790 of them next to 129
GEMMs and 64 attention launches: about 1.7 ms of a 10 ms single-request step on the H200, each a few microseconds of
latency over a few kilobytes. Here each op is one launch. The rounding steps are those of the torch ops in
layers/layernorm.py and layers/activation.py, the CPU path and the reference (the sum x + residual and the
normalized value are rounded to the input dtype before the next multiply), so outputs match them up to the order
of the float32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: out = weight * norm(x [+ residual]); residual_out = x + residual."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    """Program (row, block): out = silu(gate) * up for x = [gate | up], silu rounded to the input dtype first."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit column stride (a view when the layout allows, else a copy)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * norm(x + residual), x + residual), or (weight * norm(x), None) without a residual."""
    n_cols = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    summed = None if residual is None else torch.empty_like(rows)
    res = rows if residual is None else _rows(residual)
    res_out = rows if summed is None else summed  # not written without a residual
    block = triton.next_power_of_2(n_cols)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res,
            weight,
            out,
            res_out,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out.view(x.shape), None if summed is None else summed.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., gate | up]."""
    n_cols = x.shape[-1] // 2
    rows = _rows(x)
    out = torch.empty((rows.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(n_cols, ACT_BLOCK))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), n_cols, BLOCK=ACT_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], n_cols)

