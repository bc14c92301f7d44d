"""Triton decode attention, flash-decoding style, with in-kernel key RoPE.

Request b has one query (row b of q) at position seq_lens[b] - 1 that sees keys 0 .. seq_lens[b] - 1. Its context
is cut into at most `max_splits` chunks; stage 1 runs one program per (request, kv head, chunk) and keeps the
GQA group's query heads together, so each key is loaded and rotated once per group; stage 2 merges the chunks by
their log-sum-exp. The chunk count of a request is derived in both kernels from its length alone, so the grid
depends only on the batch size and `max_splits`: replayable in a CUDA graph with any lengths.

Decode is memory-bound: rotating keys must not cost HBM bytes or the registers that keep enough loads in flight.
Each key is rotated by its own cos/sin row, read from the table in the model's dtype (all programs read the
same rows, so they come from L2, never HBM), with packed half-precision math (`rotate_keys`). The query is
rotated once, by its own position, before the loop. Keys are not rotated from a table held in registers: such a
table takes half of them and cuts the programs resident per SM, the loads in flight that decode lives on. Against
pre-rotated keys this costs +3.5% (geometric mean over batch x context on the H200,
benchmark/results/attention_kernels_h200.json).

An fp8 pool under a bf16 model is read in fp16 tiles (`decode_tile_dtype`): fp8 widens to fp16 exactly with one
packed instruction per two values, but to bf16 only through fp16 and one more conversion per value, and with bf16
tiles the kernel issued more instructions per key block over half the bytes than over a bf16 pool.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.paged_layout import PagedKV
from sglang_pic.kernels.rope import (
    TL_DTYPES,
    HeadSplit,
    attend_paged_keys,
    check_dense_heads,
    dot_operand_dtype,
    dot_precision,
    head_split,
    load_group_query,
    merge_partials,
)
from sglang_pic.kv_cache_dtype import decode_tile_dtype

LOG2E = 1.0 / math.log(2.0)
MAX_SPLITS_CAP = 64
# Split-kernel programs one SM holds at once: shared memory bounds the Hopper tile for bf16/fp16 head_dim <= 128 to 2
# (107.5 KB each: keys, values and the keys' cos/sin rows are prefetched; the pre-rotated variant fits 3).
RESIDENT_PROGRAMS_PER_SM = 2
WAVE_SLACK = 1.15  # estimated time a split count may lose to the best one and still win by being smaller


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per inner iteration
    min_split_len: int  # shortest chunk worth its own program (a multiple of block_n)
    num_warps: int
    num_stages: int


def default_decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> DecodeConfig:
    """Hopper tiles free of register spills for head_dim 64..256 (sm_90 builds, Triton 3.6 and 3.9); tiny tiles
    for the CPU interpreter."""
    if device.type != "cuda":
        return DecodeConfig(block_n=16, min_split_len=16, num_warps=4, num_stages=1)
    if head_dim <= 128 and dtype != torch.float32:  # best of the H200 sweep (benchmark/results/kernels_sweep_h200.json)
        return DecodeConfig(block_n=128, min_split_len=256, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=32, min_split_len=256, num_warps=8, num_stages=2)


@functools.lru_cache(maxsize=None)
def num_kv_splits(
    batch_size: int, num_kv_heads: int, num_sms: int, resident_per_sm: int = RESIDENT_PROGRAMS_PER_SM
) -> int:
    """Chunks per request, chosen for whole waves of the split kernel. With s chunks each program reads 1/s of a
    request's keys, and the launch runs ceil(P * s / W) waves of W = resident_per_sm * num_sms programs (P per
    chunk index): about ceil(P * s / W) / s, in units of one request's keys per program. Takes the fewest chunks
    within WAVE_SLACK of the best such time, since each chunk adds a merge and shortens the key pipeline. Whole
    waves matter because a partly filled last wave idles SMs for a whole program's time: on the H200, 40 requests x
    8K keys run a third faster at 3 chunks than at 1."""
    per_chunk = batch_size * num_kv_heads
    wave = resident_per_sm * num_sms
    cost = {s: math.ceil(per_chunk * s / wave) / s for s in range(1, MAX_SPLITS_CAP + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= WAVE_SLACK * best)


@triton.jit
def _split_range(seq_len, MAX_SPLITS, MIN_SPLIT_LEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """(chunk length, number of non-empty chunks) of a context; both stages must agree on it."""
    wanted = tl.minimum(tl.cdiv(seq_len, MIN_SPLIT_LEN), MAX_SPLITS)
    chunk = tl.cdiv(tl.cdiv(seq_len, wanted), BLOCK_N) * BLOCK_N
    return chunk, tl.cdiv(seq_len, chunk)


# Per-batch integers (the split count, strides of per-batch buffers) and index pointers (views at any offset of a
# batch's packed upload, or sliced at a mixed batch's first decode) are not specialized: the kernels have one variant
# per model (see TritonAttnBackend.warm_up). Strides that are multiples of head_dim stay specialized, as in
# extend_attention.
@triton.jit(
    do_not_specialize=["MAX_SPLITS", "stride_mlb", "stride_mlh"],
    do_not_specialize_on_alignment=["req_pool_indices_ptr", "seq_lens_ptr"],
)
def _decode_split_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    cos_sin_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    MAX_SPLITS,
    stride_qt,
    stride_kbs,
    stride_vbs,
    stride_r2t,
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
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROTATE_KEYS: tl.constexpr,
    TILE_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    chunk, n_splits = _split_range(seq_len, MAX_SPLITS, MIN_SPLIT_LEN, BLOCK_N)
    if split >= n_splits:
        return
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, seq_len)
    req_row = tl.load(req_pool_indices_ptr + b)
    dtype = q_ptr.dtype.element_ty

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    head = kvh * GROUP + offs_h
    q1_dot, q2_dot, q_tail = load_group_query(
        q_ptr, stride_qt, b, kvh, seq_len - 1, cos_sin_ptr, stride_cs, qk_scale, dtype,
        GROUP, BLOCK_H, HEAD_DIM, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL, DOT_DTYPE,
    )
    offs_b = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_V)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    k_head = k_buf_ptr + kvh * HEAD_DIM
    v_head = v_buf_ptr + kvh * V_DIM
    r2t_row = req_to_token_ptr + req_row * stride_r2t

    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + offs_b
        n_mask = offs_n < kv_end
        slots = tl.load(r2t_row + offs_n, mask=n_mask, other=0)
        m_i, l_i, acc = attend_paged_keys(
            q1_dot, q2_dot, q_tail, k_head, v_head, slots, n_mask, offs_n, cos_sin_ptr, stride_cs, stride_kbs,
            stride_vbs, m_i, l_i, acc, TILE_DTYPE, ROTATE_KEYS, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL, V_DIM, BLOCK_V,
            DOT_DTYPE, DOT_PRECISION,
        )

    mid_o = mid_o_ptr + b * stride_mob + head[:, None] * stride_moh + split * stride_mos + offs_v[None, :]
    tl.store(mid_o, acc / l_i[:, None], mask=h_mask[:, None] & (offs_v[None, :] < V_DIM))
    mid_lse = mid_lse_ptr + b * stride_mlb + head * stride_mlh + split
    tl.store(mid_lse, m_i + tl.math.log2(l_i), mask=h_mask)


@triton.jit(
    do_not_specialize=["MAX_SPLITS", "stride_mlb", "stride_mlh"], do_not_specialize_on_alignment=["seq_lens_ptr"]
)
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    MAX_SPLITS,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ot,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (request, query head): softmax-weighted sum of the chunk outputs."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    _, n_splits = _split_range(seq_len, MAX_SPLITS, MIN_SPLIT_LEN, BLOCK_N)
    merge_partials(
        mid_o_ptr + b * stride_mob + h * stride_moh, mid_lse_ptr + b * stride_mlb + h * stride_mlh, stride_mos,
        n_splits, out_ptr + b * stride_ot + h * V_DIM, V_DIM, BLOCK_V,
    )


def alloc_decode_buffers(
    batch_size: int, num_heads: int, v_head_dim: int, max_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk partial outputs [B, Hq, S, Dv] and their base-2 log-sum-exps [B, Hq, S], float32."""
    mid_o = torch.empty((batch_size, num_heads, max_splits, v_head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((batch_size, num_heads, max_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_kernel_params(
    num_heads: int,
    num_kv_heads: int,
    split: HeadSplit,
    dtype: torch.dtype,
    device: torch.device,
    keys_rotated: bool,
    config: DecodeConfig | None = None,
    pool_dtype: torch.dtype | None = None,
) -> tuple[dict, dict]:
    """Constexprs and launch options of the split and merge kernels (the sm_90 build test compiles these) for
    queries in `dtype` over a `pool_dtype` pool (None: `dtype`)."""
    group = num_heads // num_kv_heads
    tile = decode_tile_dtype(pool_dtype or dtype, dtype)
    cfg = config or default_decode_config(split.head_dim, dtype, device)
    tiles = split.constexprs()
    split_params = {
        "GROUP": group,
        "BLOCK_H": max(16, triton.next_power_of_2(group)),
        "BLOCK_N": cfg.block_n,
        "MIN_SPLIT_LEN": cfg.min_split_len,
        "ROTATE_KEYS": not keys_rotated,
        "TILE_DTYPE": TL_DTYPES[tile],
        "DOT_DTYPE": dot_operand_dtype(tile, device),
        "DOT_PRECISION": dot_precision(tile),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **tiles,
    }
    merge_params = {
        "BLOCK_N": cfg.block_n,
        "MIN_SPLIT_LEN": cfg.min_split_len,
        "V_DIM": tiles["V_DIM"],
        "BLOCK_V": tiles["BLOCK_V"],
        "num_warps": 1,
    }
    return split_params, merge_params


def decode_attention_fwd(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: PagedKV,
    cos_sin_cache: torch.Tensor,
    sm_scale: float,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    keys_rotated: bool = False,
    config: DecodeConfig | None = None,
) -> None:
    """out [B, Hq, Dv] for q [B, Hq, D] (unrotated, row b at position kv.seq_lens[b] - 1; every seq_len >= 1).

    The split count is mid_o.shape[2] (buffers from alloc_decode_buffers). Keys are rotated in the dtype of
    `cos_sin_cache`: pass it in decode_tile_dtype(pool dtype, q's) (see RotaryEmbedding.kernel_table).
    keys_rotated=True is the baseline that reads pre-rotated keys.
    """
    batch_size, num_heads, head_dim = q.shape
    if batch_size == 0:
        return
    k_buffer, v_buffer = kv.k_buffer, kv.v_buffer
    check_dense_heads(q=q, out=out, k_buffer=k_buffer, v_buffer=v_buffer)
    num_kv_heads = k_buffer.shape[1]
    max_splits = mid_o.shape[2]
    split = head_split(head_dim, cos_sin_cache, v_buffer.shape[-1])
    split_params, merge_params = decode_kernel_params(
        num_heads, num_kv_heads, split, q.dtype, q.device, keys_rotated, config, k_buffer.dtype
    )
    _decode_split_kernel[(batch_size, num_kv_heads, max_splits)](
        q,
        k_buffer,
        v_buffer,
        cos_sin_cache,
        kv.req_to_token,
        kv.req_pool_indices,
        kv.seq_lens,
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        max_splits,
        q.stride(0),
        k_buffer.stride(0),
        v_buffer.stride(0),
        kv.req_to_token.stride(0),
        cos_sin_cache.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        **split_params,
    )
    merge_splits(mid_o, mid_lse, out, kv.seq_lens, merge_params)


def merge_splits(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor, merge_params: dict
) -> None:
    """out [B, Hq, Dv] from the chunk outputs of contexts seq_lens, split as the split kernel did."""
    _decode_merge_kernel[(out.shape[0], out.shape[1])](
        mid_o,
        mid_lse,
        out,
        seq_lens,
        mid_o.shape[2],
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        **merge_params,
    )
