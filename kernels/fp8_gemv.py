"""Triton kernel for small-M linears over fp8 (e4m3) weights with the activations left in bf16/fp16 (W8A16): decode.

fp8_linear (layers/quant_fp8.py) sends decode sizes here instead of quantizing activations for torch._scaled_mm,
which is poor at them though a decode step is bound by weight bytes and fp8 weights are half of them: at one row on
one H100, Llama-3-8B's down_proj took 56 us there against bf16's 43, and 26 us here. Each weight byte is read once,
straight from fp8, and the activations are not quantized.

Program (n, s, m) owns BLOCK_N weight rows, the s-th of `split` runs of K (whole BLOCK_K steps) and BLOCK_M activation
rows, padded to 16 or 32 (tl.dot's smallest tile is 16). Each step loads a [BLOCK_N, BLOCK_K] fp8 tile, converts it
to the activation dtype and accumulates its tl.dot with the rows in float32 (the CPU interpreter, which multiplies
bf16 tiles wrongly, gets float32 ones). The products are exact (every e4m3 value is a bf16 and an fp16 value), so
results differ from float32 math only by the order of the sums; on one H100 this beat multiplying the tile with one
row at a time on CUDA cores at every size from 1 to 32 rows. Unsplit, each program scales its sums by its rows' scales
and writes them in x's dtype. Where the grid would have fewer than `min_programs` programs, too few loads in flight to
keep memory busy, or a program more than `max_k_steps` steps over K, K is split: the programs write float32 partial
sums that a second launch adds in split order (deterministic, unlike atomics), scales and narrows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.rope import dot_operand_dtype

FP8 = torch.float8_e4m3fn
SUM_BLOCK = 256  # output columns per program of the split reduction


@dataclass(frozen=True)
class GemvConfig:
    """A launch shape. block_n is at least 16 (tl.dot's smallest tile); min_programs 0 never splits K."""

    block_n: int  # weight rows per program
    block_k: int  # weight columns per step
    num_warps: int
    min_programs: int = 0  # K is split over programs until the grid has at least this many
    max_k_steps: int = 0  # ... and until no program takes more steps over K than this (0: no limit)


# Launch shapes the benchmark compares. 528 programs: four per SM of an H100 (132 SMs).
CONFIGS = {
    "n32_k256_split": GemvConfig(block_n=32, block_k=256, num_warps=4, min_programs=528),
    "n32_k256_split1056": GemvConfig(block_n=32, block_k=256, num_warps=4, min_programs=1056),
    "n32_k256_split_k12": GemvConfig(block_n=32, block_k=256, num_warps=4, min_programs=528, max_k_steps=12),
}
# On one H100 at 1-16 rows, splitting toward 528 programs was the fastest shape for Llama-3-8B's q|k|v, o and down
# (runs of 12 steps or fewer), 1,056 programs for gate|up (56 -> 48 us: its 896 programs of 16 steps split in two);
# capping a program at 12 steps over K gives each of them its faster launch.
DEFAULT_CONFIG = CONFIGS["n32_k256_split_k12"]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    m_rows,
    n_rows,
    n_cols,
    k_per_split,
    stride_x,
    stride_w,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (n, s, m): out[m rows, n rows] = x[m rows, split s] @ w[n rows, split s].T, times the rows' scales
    into out (x's dtype) unsplit, as float32 partial sums into out[s] split."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    m_mask = offs_m[:, None] < m_rows
    n_mask = offs_n[:, None] < n_rows
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, n_cols)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        w = tl.load(w_rows + k, mask=n_mask & (k < n_cols), other=0.0)
        x = tl.load(x_rows + k, mask=m_mask & (k < n_cols), other=0.0)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc)
    out_offs = offs_m.to(tl.int64)[:, None] * n_rows + offs_n[None, :]
    mask = m_mask & (offs_n[None, :] < n_rows)
    if SPLIT:
        tl.store(out_ptr + pid_s.to(tl.int64) * m_rows * n_rows + out_offs, acc, mask=mask)
    else:
        scale = tl.load(scale_ptr + offs_n, mask=offs_n < n_rows, other=0.0)
        tl.store(out_ptr + out_offs, (acc * scale[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, scale_ptr, out_ptr, m_rows, n_rows, n_splits, BLOCK: tl.constexpr):
    """Program (row, block): out = (the split partial sums added in split order) * scale, in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_rows
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(n_splits):
        acc += tl.load(part_ptr + (s * m_rows + row) * n_rows + offs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_rows + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(m: int) -> int:
    """Activation rows per program: m padded to tl.dot's 16, or 32."""
    return 16 if m <= 16 else 32


def k_split(config: GemvConfig, m: int, n_rows: int, n_cols: int) -> tuple[int, int]:
    """(runs of K, BLOCK_K steps per run) of the launch for m rows of x and an [n_rows, n_cols] weight."""
    k_steps = triton.cdiv(n_cols, config.block_k)
    programs = triton.cdiv(n_rows, config.block_n) * triton.cdiv(m, _block_m(m))
    wanted = max(1, triton.cdiv(config.min_programs, programs),
                 triton.cdiv(k_steps, config.max_k_steps) if config.max_k_steps else 1)
    steps = triton.cdiv(k_steps, min(k_steps, wanted))
    return triton.cdiv(k_steps, steps), steps  # no empty run of K


def fp8_weight_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: GemvConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """x [..., K] (bf16 or fp16) @ the fp8 weight [N, K] with float32 scales [N] per row -> [..., N] in x's dtype:
    (sum_k x[m, k] * w[n, k]) * scale[n], accumulated in float32. Meant for a few rows of x (decode)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != FP8 or weight.stride(-1) != 1:
        raise ValueError(f"needs bf16/fp16 x and an fp8 weight of rows in place, not {x.dtype} and {weight.dtype} "
                         f"of strides {weight.stride()}")
    n_rows, n_cols = weight.shape
    rows = x.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n_rows), dtype=x.dtype, device=x.device)
    if m:
        block_m = _block_m(m)
        split, steps_per_split = k_split(config, m, n_rows, n_cols)
        partials = torch.empty((split, m, n_rows), dtype=torch.float32, device=x.device) if split > 1 else out
        grid = (triton.cdiv(n_rows, config.block_n), split, triton.cdiv(m, block_m))
        _gemv_kernel[grid](
            rows,
            weight,
            weight_scale,
            partials,
            m,
            n_rows,
            n_cols,
            steps_per_split * config.block_k,
            rows.stride(0),
            weight.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            DOT_DTYPE=dot_operand_dtype(x.dtype, x.device),
            SPLIT=split > 1,
            num_warps=config.num_warps,
        )
        if split > 1:
            _sum_splits_kernel[(m, triton.cdiv(n_rows, SUM_BLOCK))](
                partials, weight_scale, out, m, n_rows, split, BLOCK=SUM_BLOCK, num_warps=2
            )
    return out.view(*x.shape[:-1], n_rows)
