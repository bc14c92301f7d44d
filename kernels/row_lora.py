"""Triton kernels for a span adapter served apart from the weights (layers/row_lora.py): a linear's input rows with
their switched LoRA down-projection appended, [x | m * (x A^T)], so that one GEMM against [W | B] adds B's part.

Three kernels after the GEMM (x A^T, the switch, B's product added into y) read x once and y twice more: on
Llama-3-8B's gate_up, y is 7x as wide as x, and those passes cost 15% of the prefill time for 0.8% more FLOPs. Here
the input is read once and written once, 16 columns wider, and the GEMM takes B as extra input columns. The columns
are split over programs as in a split-K GEMM, so that a decode step's few rows still spread over the GPU; the
partial sums are added in a fixed order by a second small kernel, so the output does not depend on timing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.norm_act import as_rows
from sglang_pic.kernels.rope import dot_operand_dtype, dot_precision

BLOCK_K = 128
TARGET_PROGRAMS = 512  # a few waves over an H100's 132 SMs


@triton.jit
def _shrink_copy_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    part_ptr,
    n_rows,
    n_in,
    stride_x,
    stride_o,
    split_cols,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (row block, split): copy the split's columns of x's rows into out, and write x A^T over those
    columns, in float32, into part[split, rows]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    live = rows < n_rows
    ranks = tl.arange(0, RANK)
    lo = split * split_cols
    hi = tl.minimum(lo + split_cols, n_in)
    acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        inside = cols < hi
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=live[:, None] & inside[None, :], other=0.0)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], x, mask=live[:, None] & inside[None, :])
        a = tl.load(a_ptr + ranks[None, :] * n_in + cols[:, None], mask=inside[:, None], other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    tl.store(part_ptr + (split * n_rows + rows)[:, None] * RANK + ranks[None, :], acc, mask=live[:, None])


@triton.jit
def _switched_sum_kernel(part_ptr, on_ptr, out_ptr, n_rows, n_in, stride_o, n_splits, RANK: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """Program of BLOCK_M rows: the splits' partial sums added in order, times the rows' switches (0 or 1: rounding
    after the multiply is exact), rounded to out's dtype into out[:, n_in:]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < n_rows
    ranks = tl.arange(0, RANK)
    acc = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for split in range(n_splits):
        acc += tl.load(part_ptr + (split * n_rows + rows)[:, None] * RANK + ranks[None, :], mask=live[:, None])
    on = tl.load(on_ptr + rows, mask=live, other=0.0).to(tl.float32)
    low = (acc * on[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + n_in + ranks[None, :], low, mask=live[:, None])


def shrink_cat(x: torch.Tensor, a: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """[x | on * (x A^T)] for x [T, in], A [r, in] contiguous with r a power of two >= 16, and the rows' 0/1
    switches `on` [T] in x's dtype: [T, in + r], as torch.cat([x, F.linear(x, a) * on[:, None]], -1) up to the
    order of the float32 sum."""
    x = as_rows(x)
    rows, width = x.shape
    rank = a.shape[0]
    out = torch.empty(rows, width + rank, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 256 else 64
    row_blocks = triton.cdiv(rows, block_m)
    blocks = triton.cdiv(width, BLOCK_K)
    split_cols = triton.cdiv(blocks, min(blocks, triton.cdiv(TARGET_PROGRAMS, row_blocks))) * BLOCK_K
    splits = triton.cdiv(width, split_cols)
    part = torch.empty(splits, rows, rank, dtype=torch.float32, device=x.device)
    _shrink_copy_kernel[(row_blocks, splits)](
        x, a, out, part, rows, width, x.stride(0), out.stride(0), split_cols,
        RANK=rank, BLOCK_M=block_m, BLOCK_K=BLOCK_K,
        DOT_DTYPE=dot_operand_dtype(x.dtype, x.device), DOT_PRECISION=dot_precision(x.dtype),
    )
    _switched_sum_kernel[(row_blocks,)](part, on, out, rows, width, out.stride(0), splits, RANK=rank, BLOCK_M=block_m)
    return out
