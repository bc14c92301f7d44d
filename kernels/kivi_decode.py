"""Triton decode attention over a KIVI draft cache: a 2-bit quantized prefix followed by exact rows of the pool.

Request b sees keys 0 .. total[b] - 1: indices below prefix_lens[b] are dequantized on read from the request's
own packed tensors (their addresses come per request in `quant_ptrs`, so no copy into a shared pool is needed),
the rest are pool slots listed in `table[b, index - prefix_lens[b]]`. Every key is rotated by its index, its
true position, as in the plain decode kernel; the query sits at total[b] - 1.

The context is split into chunks exactly as `decode_attention` does (same `_split_range`), so that kernel's merge
stage combines the chunks. A key block never straddles the prefix's end: blocks start at multiples of BLOCK_N,
which divides the quantization group, and prefixes end on a group boundary.

Layouts (contiguous, per layer and request, H kv heads, D key and Dv value channels, G tokens per key group):
key codes [T, H, D / 4] uint8 with channel c in bits 2 (c % 4); key scale and zero [T / G, H, D] float32 (one per
channel and group of tokens); value codes [T, H, Dv / 4]; value scale and zero [T, H, Dv / VG] float32 (one per
token and group of VG channels). A value is code * scale + zero. Codes are read as whole bytes and unpacked in
registers; a key block lies inside one group, so its scales are one row per channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.decode_attention import LOG2E, _split_range, default_decode_config, merge_splits
from sglang_pic.kernels.rope import (
    HeadSplit,
    attend_block,
    check_dense_heads,
    dot_operand_dtype,
    dot_precision,
    load_cos_sin,
    load_group_query,
    rotate_keys,
)

QUANT_FIELDS = 6  # addresses per request and layer: key codes, key scale, key zero, value codes, scale, zero
_FIELDS = tl.constexpr(QUANT_FIELDS)
CODES_PER_BYTE = tl.constexpr(4)  # 2-bit codes
KIVI_BLOCK_N_GPU = 32


@triton.jit
def _load_codes(rows, c0, limit, n_mask, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """2-bit codes [BLOCK_N, BLOCK_C] of channels c0 .. c0 + BLOCK_C - 1 (c0 a multiple of 4) as float32, read as
    whole bytes per row (`rows`: [BLOCK_N] pointers to each token's packed head); channels from `limit` on are 0."""
    offs = tl.arange(0, BLOCK_C // CODES_PER_BYTE)
    mask = n_mask[:, None] & (c0 + CODES_PER_BYTE * offs[None, :] < limit)
    byte = tl.load(rows[:, None] + c0 // CODES_PER_BYTE + offs[None, :], mask=mask, other=0).to(tl.int32)
    # Channel 4j + i sits in bits 2i of byte j. Joining codes (0, 2) and (1, 3), then the two pairs, gives a
    # trailing [2, 2] whose row-major order is 0, 1, 2, 3.
    even = tl.join(byte & 3, (byte >> 4) & 3)
    odd = tl.join((byte >> 2) & 3, (byte >> 6) & 3)
    return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_C]).to(tl.float32)


@triton.jit
def _dequant_keys(codes, scale, zero, group, n, n_mask, kvh, num_kv_heads, c0, limit, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Keys [BLOCK_N, BLOCK_C] (channels c0 ..) in float32; the block lies in one quantization group, so each
    channel's scale and zero are loaded once."""
    rows = codes + (n * num_kv_heads + kvh) * (HEAD_DIM // CODES_PER_BYTE)
    q = _load_codes(rows, c0, limit, n_mask, BLOCK_N, BLOCK_C)
    ch = c0 + tl.arange(0, BLOCK_C)
    at = (group * num_kv_heads + kvh) * HEAD_DIM + ch
    s = tl.load(scale + at, mask=ch < limit, other=0.0)
    z = tl.load(zero + at, mask=ch < limit, other=0.0)
    return q * s[None, :] + z[None, :]


@triton.jit
def _dequant_values(codes, scale, zero, n, n_mask, kvh, num_kv_heads, V_DIM: tl.constexpr, VGROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Values [BLOCK_N, BLOCK_V] in float32: one scale and zero per token and group of VGROUP channels."""
    row = n * num_kv_heads + kvh
    q = _load_codes(codes + row * (V_DIM // CODES_PER_BYTE), 0, V_DIM, n_mask, BLOCK_N, BLOCK_V)
    groups = tl.arange(0, BLOCK_V // VGROUP)
    mask = n_mask[:, None] & (groups[None, :] < V_DIM // VGROUP)
    at = row[:, None] * (V_DIM // VGROUP) + groups[None, :]
    s = tl.load(scale + at, mask=mask, other=0.0)
    z = tl.load(zero + at, mask=mask, other=0.0)
    q = tl.reshape(q, [BLOCK_N, BLOCK_V // VGROUP, VGROUP])
    return tl.reshape(q * s[:, :, None] + z[:, :, None], [BLOCK_N, BLOCK_V])


@triton.jit
def _kivi_split_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    cos_sin_ptr,
    table_ptr,
    totals_ptr,
    prefix_lens_ptr,
    quant_ptrs_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    num_kv_heads,
    MAX_SPLITS,
    stride_qt,
    stride_kbs,
    stride_vbs,
    stride_table,
    stride_cs,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    QGROUP: tl.constexpr,
    VGROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    total = tl.load(totals_ptr + b).to(tl.int32)
    chunk, n_splits = _split_range(total, MAX_SPLITS, MIN_SPLIT_LEN, BLOCK_N)
    if split >= n_splits:
        return
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, total)
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    dtype = q_ptr.dtype.element_ty
    quant = quant_ptrs_ptr + b * _FIELDS
    k_codes = tl.load(quant).to(tl.pointer_type(tl.uint8))
    k_scale = tl.load(quant + 1).to(tl.pointer_type(tl.float32))
    k_zero = tl.load(quant + 2).to(tl.pointer_type(tl.float32))
    v_codes = tl.load(quant + 3).to(tl.pointer_type(tl.uint8))
    v_scale = tl.load(quant + 4).to(tl.pointer_type(tl.float32))
    v_zero = tl.load(quant + 5).to(tl.pointer_type(tl.float32))

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    head = kvh * GROUP + offs_h
    q1_dot, q2_dot, q_tail = load_group_query(
        q_ptr, stride_qt, b, kvh, total - 1, cos_sin_ptr, stride_cs, qk_scale, dtype,
        GROUP, BLOCK_H, HEAD_DIM, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL, DOT_DTYPE,
    )
    offs_r = tl.arange(0, BLOCK_HALF)
    offs_t = tl.arange(0, BLOCK_TAIL)
    offs_b = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_V)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    k_head = k_buf_ptr + kvh * HEAD_DIM
    v_head = v_buf_ptr + kvh * V_DIM
    table_row = table_ptr + b * stride_table

    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + offs_b
        n_mask = offs_n < kv_end
        k_tail = tl.zeros([BLOCK_N, BLOCK_TAIL], tl.float32)
        if start_n < prefix_len:
            group = start_n // QGROUP
            k1 = _dequant_keys(k_codes, k_scale, k_zero, group, offs_n, n_mask, kvh, num_kv_heads, 0, HALF,
                               HEAD_DIM, BLOCK_N, BLOCK_HALF)
            k2 = _dequant_keys(k_codes, k_scale, k_zero, group, offs_n, n_mask, kvh, num_kv_heads, HALF, 2 * HALF,
                               HEAD_DIM, BLOCK_N, BLOCK_HALF)
            if TAIL > 0:
                k_tail = _dequant_keys(k_codes, k_scale, k_zero, group, offs_n, n_mask, kvh, num_kv_heads, 2 * HALF,
                                       HEAD_DIM, HEAD_DIM, BLOCK_N, BLOCK_TAIL)
            v = _dequant_values(v_codes, v_scale, v_zero, offs_n, n_mask, kvh, num_kv_heads, V_DIM, VGROUP, BLOCK_N,
                                BLOCK_V)
        else:
            slots = tl.load(table_row + offs_n - prefix_len, mask=n_mask, other=0)
            k_rows = k_head + slots[:, None] * stride_kbs
            k_mask = n_mask[:, None] & (offs_r[None, :] < HALF)
            t_mask = n_mask[:, None] & (offs_t[None, :] < TAIL)
            v_mask = n_mask[:, None] & (offs_v[None, :] < V_DIM)
            k1 = tl.load(k_rows + offs_r[None, :], mask=k_mask, other=0.0).to(tl.float32)
            k2 = tl.load(k_rows + HALF + offs_r[None, :], mask=k_mask, other=0.0).to(tl.float32)
            if TAIL > 0:
                k_tail = tl.load(k_rows + 2 * HALF + offs_t[None, :], mask=t_mask, other=0.0).to(tl.float32)
            v = tl.load(v_head + slots[:, None] * stride_vbs + offs_v[None, :], mask=v_mask, other=0.0).to(tl.float32)
        k_cos, k_sin = load_cos_sin(cos_sin_ptr, stride_cs, offs_n, offs_r, n_mask, HALF)
        k1, k2 = rotate_keys(k1.to(dtype), k2.to(dtype), k_cos, k_sin)
        qk = tl.dot(q1_dot, tl.trans(k1.to(dtype).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        qk = tl.dot(q2_dot, tl.trans(k2.to(dtype).to(DOT_DTYPE)), qk, input_precision=DOT_PRECISION)
        if TAIL > 0:
            qk = tl.dot(q_tail, tl.trans(k_tail.to(dtype).to(DOT_DTYPE)), qk, input_precision=DOT_PRECISION)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_i, l_i, acc = attend_block(qk, v.to(dtype), m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)

    mid_o = mid_o_ptr + b * stride_mob + head[:, None] * stride_moh + split * stride_mos + offs_v[None, :]
    tl.store(mid_o, acc / l_i[:, None], mask=h_mask[:, None] & (offs_v[None, :] < V_DIM))
    mid_lse = mid_lse_ptr + b * stride_mlb + head * stride_mlh + split
    tl.store(mid_lse, m_i + tl.math.log2(l_i), mask=h_mask)


def kivi_kernel_params(
    num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, v_head_dim: int, quant_group: int,
    value_group: int, dtype: torch.dtype, device: torch.device,
) -> tuple[dict, dict]:
    """Constexprs and launch options of the split kernel and of decode_attention's merge kernel."""
    if rotary_dim % 8 or head_dim % 4 or v_head_dim % 4:
        raise ValueError(f"KIVI kernel reads whole bytes of codes per head part: rotary_dim ({rotary_dim}) must be a "
                         f"multiple of 8, head_dim ({head_dim}) and v_head_dim ({v_head_dim}) of 4")
    base = default_decode_config(head_dim, dtype, device)
    block_n = KIVI_BLOCK_N_GPU if device.type == "cuda" else base.block_n
    if quant_group % block_n:
        raise ValueError(f"KIVI group {quant_group} must be a multiple of the key block {block_n}")
    group = num_heads // num_kv_heads
    tiles = HeadSplit(head_dim, rotary_dim, v_head_dim).constexprs()
    split_params = {
        "GROUP": group,
        "BLOCK_H": max(16, triton.next_power_of_2(group)),
        "BLOCK_N": block_n,
        "MIN_SPLIT_LEN": max(base.min_split_len, block_n),
        "QGROUP": quant_group,
        "VGROUP": value_group,
        "DOT_DTYPE": dot_operand_dtype(dtype, device),
        "DOT_PRECISION": dot_precision(dtype),
        "num_warps": 4,
        "num_stages": 2 if device.type == "cuda" else 1,
        **tiles,
    }
    merge_params = {
        "BLOCK_N": block_n,
        "MIN_SPLIT_LEN": split_params["MIN_SPLIT_LEN"],
        "V_DIM": tiles["V_DIM"],
        "BLOCK_V": tiles["BLOCK_V"],
        "num_warps": 1,
    }
    return split_params, merge_params


@dataclass(frozen=True)
class KiviKV:
    """One layer's draft keys of a batch of requests (see the module docstring): request b's keys below
    prefix_lens[b] are its quantized prefix, the rest pool slots table[b, j - prefix_lens[b]] of the buffers."""

    k_buffer: torch.Tensor  # [slots, Hkv, D] the exact rows' pool
    v_buffer: torch.Tensor  # [slots, Hkv, Dv]
    table: torch.Tensor  # [B, W] int64
    totals: torch.Tensor  # [B] int64 keys per request, prefix included
    prefix_lens: torch.Tensor  # [B] int64
    quant_ptrs: torch.Tensor  # [B, QUANT_FIELDS] int64 addresses of each request's quantized tensors
    quant_group: int  # tokens per key quantization group
    value_group: int  # channels per value quantization group


def kivi_decode_fwd(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: KiviKV,
    cos_sin_cache: torch.Tensor,
    sm_scale: float,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
) -> None:
    """out [B, Hq, Dv] for unrotated q [B, Hq, D], row b at position kv.totals[b] - 1.

    kv.quant_ptrs may hold any valid address for a request whose prefix_lens is 0: it is never read. The split
    count is mid_o.shape[2].
    """
    batch_size, num_heads, head_dim = q.shape
    if batch_size == 0:
        return
    k_buffer, v_buffer, table = kv.k_buffer, kv.v_buffer, kv.table
    check_dense_heads(q=q, out=out, k_buffer=k_buffer, v_buffer=v_buffer)
    num_kv_heads = k_buffer.shape[1]
    max_splits = mid_o.shape[2]
    split_params, merge_params = kivi_kernel_params(
        num_heads, num_kv_heads, head_dim, cos_sin_cache.shape[-1], v_buffer.shape[-1], kv.quant_group,
        kv.value_group, q.dtype, q.device,
    )
    _kivi_split_kernel[(batch_size, num_kv_heads, max_splits)](
        q,
        k_buffer,
        v_buffer,
        cos_sin_cache,
        table,
        kv.totals,
        kv.prefix_lens,
        kv.quant_ptrs,
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        num_kv_heads,
        max_splits,
        q.stride(0),
        k_buffer.stride(0),
        v_buffer.stride(0),
        table.stride(0),
        cos_sin_cache.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        **split_params,
    )
    merge_splits(mid_o, mid_lse, out, kv.totals, merge_params)
