"""Triton kernels for the small per-token ops between the GEMMs: RMSNorm with the residual add, and SiLU-and-mul.

Written as torch ops, one pre-norm with its residual add launches about eight kernels (add, widen, square, mean,
rsqrt, two multiplies, narrow), and the gated activation three. A Llama-3-8B step ran ~790 of them next to 129
GEMMs and 64 attention launches: about 1.7 ms of a 10 ms single-request step on the H200, each a few microseconds of
latency over a few kilobytes. Here each op is one launch. The rounding steps are those of the torch ops in
layers/layernorm.py and layers/activation.py, the CPU path and the reference (the sum x + residual and the
normalized value are rounded to the input dtype before the next multiply), so outputs match them up to the order
of the float32 sum of squares.

Before an fp8 linear (`--quantization fp8`, steps of more rows than go to the W8A16 kernel) the norm and the
activation also quantize their output per token for the GEMM (`rms_norm_fp8`, `silu_and_mul_fp8`): the value each
writes is the one it writes unquantized, in its dtype, then quantized as kernels/quant_fp8.py does, bit for bit;
that saves the quantization kernel's launch (host time bounds the fp8 run's eager steps) and its read of the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.quant_fp8 import FP8, FP8_MAX, MAX_BLOCK, row_scale, to_e4m3

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
    scale_ptr,
    fp8_max,
    min_amax,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    VALUE_DTYPE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program per row: y = weight * norm(x [+ residual]) in VALUE_DTYPE, residual_out = x + residual; out = y,
    or with QUANT y quantized per row (its scale into scale_ptr)."""
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
    y = (w * normed).to(VALUE_DTYPE)
    if QUANT:
        yf = y.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(yf), 0), min_amax, fp8_max)
        tl.store(scale_ptr + row, scale)
        q = to_e4m3(yf, scale, fp8_max)
        tl.store(out_ptr + row * stride_o + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _silu_and_mul_value(x_row, offs, mask, n_cols):
    """silu(gate) * up at `offs` of one row of [gate | up], in the input dtype, as _silu_and_mul_kernel writes it."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    """Program (row, block): out = silu(gate) * up for x = [gate | up], silu rounded to the input dtype first."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    y = _silu_and_mul_value(x_ptr + row * stride_x, offs, mask, n_cols)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, fp8_max, min_amax, BLOCK: tl.constexpr
):
    """One program per row: the row of silu(gate) * up (in the input dtype) quantized per row. It is computed twice,
    for the amax and for the values, as kernels/quant_fp8.py reads its row twice."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        y = _silu_and_mul_value(x_row, start + offs, start + offs < n_cols, n_cols)
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
    scale = row_scale(tl.max(amax, 0), min_amax, fp8_max)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        y = _silu_and_mul_value(x_row, start + offs, mask, n_cols).to(tl.float32)
        q = to_e4m3(y, scale, fp8_max)
        tl.store(q_ptr + row * stride_q + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit column stride (a view when the layout allows, else a copy)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * norm(x + residual), x + residual), or (weight * norm(x), None) without a residual."""
    out, _, summed = _rms_norm(x, weight, eps, residual, None)
    return out, summed


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, min_amax: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """rms_norm's output quantized per row as quantize_rows_fp8 would (fp8 values, float32 scales [...]), and
    x + residual (None without a residual)."""
    return _rms_norm(x, weight, eps, residual, min_amax)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, min_amax: float | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(out, scales, summed): out in the norm's dtype, or with `min_amax` in fp8 with its per-row scales."""
    n_cols = x.shape[-1]
    rows = as_rows(x)
    value_dtype = torch.result_type(weight, x)
    quant = min_amax is not None
    out = torch.empty(rows.shape, dtype=FP8 if quant else value_dtype, device=x.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device) if quant else None
    summed = None if residual is None else torch.empty_like(rows)
    res = rows if residual is None else as_rows(residual)
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
            out if scales is None else scales,  # not written unquantized
            FP8_MAX,
            min_amax or 0.0,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            VALUE_DTYPE=_TL_DTYPES[value_dtype],
            QUANT=quant,
            num_warps=min(16, max(1, block // 512)),
        )
    return (out.view(x.shape), None if scales is None else scales.view(x.shape[:-1]),
            None if summed is None else summed.view(x.shape))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [..., gate | up]."""
    n_cols = x.shape[-1] // 2
    rows = as_rows(x)
    out = torch.empty((rows.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(n_cols, ACT_BLOCK))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), n_cols, BLOCK=ACT_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], n_cols)


def silu_and_mul_fp8(x: torch.Tensor, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul's output quantized per row as quantize_rows_fp8 would: (fp8 [..., n], float32 scales [...])."""
    n_cols = x.shape[-1] // 2
    rows = as_rows(x)
    q = torch.empty((rows.shape[0], n_cols), dtype=FP8, device=x.device)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))
        _silu_and_mul_fp8_kernel[(rows.shape[0],)](
            rows, q, scales, rows.stride(0), q.stride(0), n_cols, FP8_MAX, min_amax, BLOCK=block,
            num_warps=min(8, max(1, block // 512)),
        )
    return q.view(*x.shape[:-1], n_cols), scales.view(x.shape[:-1])
