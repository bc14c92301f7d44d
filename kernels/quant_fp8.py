"""Triton kernel for dynamic per-token fp8 (e4m3fn) quantization of activations, the step before every fp8 GEMM.

In torch (`quantize_rows` in layers/quant_fp8.py, the CPU path and the reference) it is four or five kernels: the
amax reduction, the scale, a float32 division that writes an [M, K] float32 tensor, the clamp and the narrowing,
so about three times the activation's bytes cross memory per linear. Here one program reads its row twice (the
amax, then the values; the second read mostly hits L2) and writes only the fp8 row and its scale.

The numbers are quantize_rows' on CPU, bit for bit, for finite inputs: the same float32 steps with IEEE division
(`div_rn`; Triton's `/` is an approximate division on NVIDIA GPUs), then rounding to nearest even onto the e4m3
grid in float32 (`_round_to_e4m3`) before the cast. Rounding there rather than in the cast because Triton's
float32 -> fp8 cast rounds differently by version and target (some convert through fp16 first, rounding twice) and
the interpreter's rounds ties away from zero and can lose a carry; the cast of an e4m3 value is exact on all of
them. The scale is a true division amax / 448, as torch computes it on CPU (torch on CUDA multiplies by a rounded
1/448 instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MAX_BLOCK = 4096  # elements per loop step: a Llama-3-8B hidden row (4096) in one step, its MLP row (14336) in four


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32. Where 2^e is v's binade
    (at least 2^-6, e4m3's smallest normal), adding 2^(e + 20) leaves float32 a unit of 2^(e - 3), e4m3's spacing
    there, so the float32 addition's own rounding does it; subtracting it back is exact. The sign is v's, zeros'
    included: its bit is copied, since Triton negates a float as 0 - r, which turns -0 into +0 on the GPU."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    binade = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127 - 6)  # biased float32 exponent
    offset = ((binade + 20) << 23).to(tl.float32, bitcast=True)
    r = ((a + offset) - offset).to(tl.int32, bitcast=True)
    return (r | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def row_scale(amax, min_amax, fp8_max):
    """A row's scale from its amax: max(amax, min_amax) / fp8_max, a true division as torch's on CPU."""
    return tl.math.div_rn(tl.maximum(amax, min_amax), fp8_max)


@triton.jit
def to_e4m3(v, scale, fp8_max):
    """v (float32) over its row's scale, clamped to +-fp8_max and rounded onto the e4m3 grid: values the cast to fp8
    keeps exactly. The quantization of every kernel that writes fp8 activations (norm_act.py's too)."""
    return _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -fp8_max), fp8_max))


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    stride_q,
    n_cols,
    fp8_max,
    min_amax,
    BLOCK: tl.constexpr,
):
    """One program per row: scale = max(amax, min_amax) / fp8_max, q = clamp(x / scale, +-fp8_max) in fp8."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < n_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = row_scale(tl.max(amax, 0), min_amax, fp8_max)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = to_e4m3(x, scale, fp8_max)
        tl.store(q_row + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_fp8(x: torch.Tensor, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16, fp16 or fp32) -> (fp8 [..., K] contiguous, float32 scales [...]), each row over its own
    max(amax, min_amax) / 448, in one launch."""
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q = torch.empty(rows.shape, dtype=FP8, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1)))
    if rows.shape[0]:
        _quantize_rows_kernel[(rows.shape[0],)](
            rows,
            q,
            scale,
            rows.stride(0),
            q.stride(0),
            n_cols,
            FP8_MAX,
            min_amax,
            BLOCK=block,
            num_warps=min(8, max(1, block // 512)),
        )
    return q.view(x.shape), scale.view(x.shape[:-1])
