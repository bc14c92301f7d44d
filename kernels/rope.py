"""Pieces shared by the Triton attention kernels: head tiling, in-register RoPE, dot operand types, chunk merging.

A head of `head_dim` elements is handled as three tiles so that rotation needs no shuffles: the first rotary half
[0, R/2), the second rotary half [R/2, R) and the unrotated tail [R, D) (empty for full-rotary models). Every
tile is padded to a power of two of at least 16 so it can feed `tl.dot`; masks cover the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_DOT_DIM = 16


def _tile(n: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(max(n, 1)))


@dataclass(frozen=True)
class HeadSplit:
    """Sizes of the three head tiles, passed to kernels as constexprs."""

    head_dim: int
    rotary_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")

    def constexprs(self) -> dict[str, int]:
        half = self.rotary_dim // 2
        tail = self.head_dim - self.rotary_dim
        return {
            "HEAD_DIM": self.head_dim,
            "HALF": half,
            "BLOCK_HALF": _tile(half),
            "TAIL": tail,
            "BLOCK_TAIL": _tile(tail),
            "V_DIM": self.v_head_dim,
            "BLOCK_V": _tile(self.v_head_dim),
        }


def head_split(head_dim: int, cos_sin_cache: torch.Tensor, v_head_dim: int | None = None) -> HeadSplit:
    return HeadSplit(head_dim, cos_sin_cache.shape[-1], v_head_dim or head_dim)


def check_dense_heads(**tensors: torch.Tensor) -> None:
    """Kernels address head h of a token row at h * dim: heads must be packed densely inside each row (true for
    the pool and for views of a fused qkv projection); only the row stride is free."""
    for name, x in tensors.items():
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            raise ValueError(f"{name} must have dense [heads, dim] rows, got strides {tuple(x.stride())}")


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products (tests, debugging); half types ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_operand_dtype(dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """Type fed to tl.dot. The CPU interpreter multiplies bf16 tiles wrongly, so there operands are rounded to
    bf16 (same values as on the GPU) and then widened to fp32, whose products of bf16 values are exact."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return tl.float32
    return TL_DTYPES[dtype]


@triton.jit
def load_cos_sin(cos_sin_ptr, stride_cs, pos, offs_half, row_mask, HALF: tl.constexpr):
    """cos and sin tiles [len(pos), len(offs_half)] for positions `pos`; padding gets the identity (1, 0)."""
    mask = row_mask[:, None] & (offs_half[None, :] < HALF)
    ptrs = cos_sin_ptr + pos[:, None] * stride_cs + offs_half[None, :]
    cos = tl.load(ptrs, mask=mask, other=1.0)
    sin = tl.load(ptrs + HALF, mask=mask, other=0.0)
    return cos, sin


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """neox rotate_half on the two rotary halves, in float32: (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def rotate_keys(k1, k2, cos, sin):
    """rotate_half of key tiles in the table's dtype. Kernels get the table in the model's dtype, so bf16 keys
    are rotated with packed bf16 math: a quarter of the fp32 path's instructions (no widening and narrowing),
    with errors the size of the rounding that storing pre-rotated bf16 keys incurs anyway."""
    k1 = k1.to(cos.dtype)
    k2 = k2.to(cos.dtype)
    return k1 * cos - k2 * sin, k2 * cos + k1 * sin


@triton.jit
def copy_key_rows(
    src,
    dst,
    row_mask,
    pos,
    cos_sin_ptr,
    stride_cs,
    ROTATE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """Copy key heads from `src` to `dst` (pointer columns [rows, 1] at each head's first element), rotating the
    rotary halves by `pos` (float32 math) when ROTATE; the unrotated tail is copied as is."""
    dtype = dst.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (offs_r[None, :] < HALF)
    k1 = tl.load(src + offs_r[None, :], mask=mask, other=0.0)
    k2 = tl.load(src + HALF + offs_r[None, :], mask=mask, other=0.0)
    if ROTATE:
        cos, sin = load_cos_sin(cos_sin_ptr, stride_cs, pos, offs_r, row_mask, HALF)
        k1, k2 = rotate_halves(k1, k2, cos, sin)
    tl.store(dst + offs_r[None, :], k1.to(dtype), mask=mask)
    tl.store(dst + HALF + offs_r[None, :], k2.to(dtype), mask=mask)
    if TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        tail_mask = row_mask[:, None] & (offs_t[None, :] < TAIL)
        tail = tl.load(src + 2 * HALF + offs_t[None, :], mask=tail_mask, other=0.0)
        tl.store(dst + 2 * HALF + offs_t[None, :], tail.to(dtype), mask=tail_mask)


@triton.jit
def merge_chunk(m, denom, acc, lse, o):
    """Fold one key chunk's normalized output `o` and base-2 log-sum-exp `lse` into a running merge (m, denom,
    acc); the result is acc / denom. A chunk with lse = -inf adds nothing."""
    m_new = tl.maximum(m, lse)
    scale_old = tl.math.exp2(m - m_new)
    weight = tl.math.exp2(lse - m_new)
    return m_new, denom * scale_old + weight, acc * scale_old + o * weight


@triton.jit
def attend_block(qk, v, m_i, l_i, acc, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key block: base-2 scores qk [M, N] (hidden keys at -inf) and values v [N, Dv]
    fold into the running max m_i, sum l_i and output acc; probabilities are rounded to v's dtype for the dot."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def merge_partials(mid_o, mid_lse, stride_mos, count, out, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr):
    """Store at `out` the softmax-weighted sum of `count` normalized partial outputs (mid_o + s * stride_mos) with
    base-2 log-sum-exps mid_lse[s]. A partial with lse = -inf weighs nothing (the running max starts finite, so
    such a partial first is harmless); with none at all the output is zeros (a CUDA graph's padded request)."""
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    m = -1.0e30
    denom = 0.0
    acc = tl.zeros([BLOCK_V], tl.float32)
    for s in range(0, count):
        lse = tl.load(mid_lse + s)
        o = tl.load(mid_o + s * stride_mos + offs_v, mask=v_mask, other=0.0)
        m, denom, acc = merge_chunk(m, denom, acc, lse, o)
    tl.store(out + offs_v, (acc / tl.maximum(denom, 1e-30)).to(out.dtype.element_ty), mask=v_mask)


@triton.jit
def key_scores(
    q1,
    q2,
    q_tail,
    k1,
    k2,
    k_rows,
    n_mask,
    dtype: tl.constexpr,
    HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Scores [rows, keys] of the query operands of load_query_rows against a key block: its rotary halves k1, k2
    (rotated already where that is due) and its unrotated tail, read here from `k_rows` (a pointer column at each
    key's first element; `n_mask` masks the block's padding)."""
    qk = tl.dot(q1, tl.trans(k1.to(dtype).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    qk = tl.dot(q2, tl.trans(k2.to(dtype).to(DOT_DTYPE)), qk, input_precision=DOT_PRECISION)
    if TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        k_tail_mask = n_mask[:, None] & (offs_t[None, :] < TAIL)
        k_tail = tl.load(k_rows + 2 * HALF + offs_t[None, :], mask=k_tail_mask, other=0.0)
        qk = tl.dot(q_tail, tl.trans(k_tail.to(DOT_DTYPE)), qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def attend_paged_keys(
    q1,
    q2,
    q_tail,
    k_head,
    v_head,
    slots,
    n_mask,
    key_pos,
    cos_sin_ptr,
    stride_cs,
    stride_kbs,
    stride_vbs,
    m_i,
    l_i,
    acc,
    dtype: tl.constexpr,
    ROTATE_KEYS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One block of decode keys read from the pool: the keys and values at `slots` of one kv head (`k_head`,
    `v_head`: the head's first element in the pools; `n_mask` masks the block's padding), keys rotated by
    `key_pos` when ROTATE_KEYS, against the query operands of load_query_rows; folds into (m_i, l_i, acc). Pool
    tiles are widened to the model's `dtype` as they load (an fp8 pool's included)."""
    offs_r = tl.arange(0, BLOCK_HALF)
    offs_v = tl.arange(0, BLOCK_V)
    k_rows = k_head + slots[:, None] * stride_kbs
    k_mask = n_mask[:, None] & (offs_r[None, :] < HALF)
    k1 = tl.load(k_rows + offs_r[None, :], mask=k_mask, other=0.0).to(dtype)
    k2 = tl.load(k_rows + HALF + offs_r[None, :], mask=k_mask, other=0.0).to(dtype)
    if ROTATE_KEYS:
        k_cos, k_sin = load_cos_sin(cos_sin_ptr, stride_cs, key_pos, offs_r, n_mask, HALF)
        k1, k2 = rotate_keys(k1, k2, k_cos, k_sin)
    qk = key_scores(q1, q2, q_tail, k1, k2, k_rows, n_mask, dtype, HALF, TAIL, BLOCK_TAIL, DOT_DTYPE, DOT_PRECISION)
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    v_mask = n_mask[:, None] & (offs_v[None, :] < V_DIM)
    v = tl.load(v_head + slots[:, None] * stride_vbs + offs_v[None, :], mask=v_mask, other=0.0).to(dtype)
    return attend_block(qk, v, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)


@triton.jit
def load_query_rows(
    q_rows,
    row_mask,
    pos,
    cos_sin_ptr,
    stride_cs,
    qk_scale,
    dtype: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Query heads (pointer column `q_rows` [BLOCK_ROWS, 1] at each head's first element), scaled and rotated
    each by its own position `pos`: the dot operands of the two rotary halves and of the tail (zeros without one),
    rounded to the model's dtype like keys are."""
    offs_r = tl.arange(0, BLOCK_HALF)
    q_mask = row_mask[:, None] & (offs_r[None, :] < HALF)
    q1 = tl.load(q_rows + offs_r[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_rows + HALF + offs_r[None, :], mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    cos, sin = load_cos_sin(cos_sin_ptr, stride_cs, pos, offs_r, row_mask, HALF)
    q1, q2 = rotate_halves(q1, q2, cos, sin)
    q_tail = tl.zeros([BLOCK_ROWS, BLOCK_TAIL], tl.float32)
    if TAIL > 0:
        offs_t = tl.arange(0, BLOCK_TAIL)
        tail_mask = row_mask[:, None] & (offs_t[None, :] < TAIL)
        q_tail = tl.load(q_rows + 2 * HALF + offs_t[None, :], mask=tail_mask, other=0.0).to(tl.float32) * qk_scale
    return q1.to(dtype).to(DOT_DTYPE), q2.to(dtype).to(DOT_DTYPE), q_tail.to(dtype).to(DOT_DTYPE)


@triton.jit
def load_group_query(
    q_ptr,
    stride_qt,
    row,
    kvh,
    pos,
    cos_sin_ptr,
    stride_cs,
    qk_scale,
    dtype: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """A decode query's heads that share kv head `kvh`, at position `pos` (see load_query_rows)."""
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    q_rows = q_ptr + row * stride_qt + (kvh * GROUP + offs_h)[:, None] * HEAD_DIM
    return load_query_rows(
        q_rows, h_mask, tl.zeros([BLOCK_H], tl.int32) + pos, cos_sin_ptr, stride_cs, qk_scale, dtype,
        BLOCK_H, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL, DOT_DTYPE,
    )
