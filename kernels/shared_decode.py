"""Decode attention that reads each shared KV run once for every request holding it, at whatever offset.

Position-free keys let one physical run of KV slots (a cached span, a shared system prompt) sit at different
logical offsets in many running requests. A per-request decode kernel reads such a run once per request; when many
requests hold one long document or tool description, most of a step's KV bytes are those repeats. Here a step's
keys are cut into runs: every group of requests whose rows hold the same slots over a run (`KeyRun.key`) shares one
run, and whatever no group covers is a private run of one request. One program loads a chunk of a run's keys once
and attends to it with the queries of up to `members_per_item` of its requests together, which turns the decode's
matrix-vector products into small matrix products on the tensor cores.

The offsets differ per request, so the rotation is split: for a query at position p and a run starting at o in
its request, key j of the run sits at o + j and RoPE's score is
    R(p) q . R(o + j) k  =  R(p - o) q . R(j) k,
so keys are rotated by their index inside the run (the same for every member) and each member's query by p - o
(between the run's length and p: always inside the cos/sin table). Every (request, run chunk) writes a partial
output and its log-sum-exp; a merge kernel folds each request's partials, as flash-decoding folds its splits.

The plan is built on the host per step (managers/shared_decode_planner.py) from plain integers, in the layout of
shared_decode_plan.py; this module knows nothing of requests or the radix tree.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.paged_layout import PagedKV
from sglang_pic.kernels.rope import (
    HeadSplit,
    attend_paged_keys,
    check_dense_heads,
    dot_operand_dtype,
    dot_precision,
    head_split,
    load_query_rows,
    merge_partials,
)
from sglang_pic.kernels.shared_decode_plan import SharedDecodePlan, members_per_item

LOG2E = 1.0 / math.log(2.0)


@triton.jit(do_not_specialize=["stride_mlb", "stride_mlh"])
def _shared_decode_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    cos_sin_ptr,
    req_to_token_ptr,
    items_ptr,
    members_ptr,
    num_items_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    """One program per (item row, kv head): the item's keys against its members' queries of that kv head's group.
    Rows past the live items (a CUDA graph's grid covers its static plan) return at once."""
    if tl.program_id(0) >= tl.load(num_items_ptr):
        return
    item = items_ptr + tl.program_id(0) * 6
    kvh = tl.program_id(1)
    row = tl.load(item)
    key_lo = tl.load(item + 1)
    n_keys = tl.load(item + 2).to(tl.int32)
    run_index = tl.load(item + 3).to(tl.int32)
    member_lo = tl.load(item + 4)
    member_cnt = tl.load(item + 5).to(tl.int32)
    dtype = q_ptr.dtype.element_ty

    # Query row m is head m % GROUP of member m // GROUP, rotated by that member's position minus the run's start.
    offs_m = tl.arange(0, BLOCK_M)
    member = offs_m // GROUP
    m_mask = member < member_cnt
    entry = members_ptr + (member_lo + member) * 3
    b = tl.load(entry, mask=m_mask, other=0)
    angle = tl.load(entry + 1, mask=m_mask, other=0)
    slot = tl.load(entry + 2, mask=m_mask, other=0)
    head = kvh * GROUP + offs_m % GROUP
    q1, q2, q_tail = load_query_rows(
        q_ptr + b[:, None] * stride_qt + head[:, None] * HEAD_DIM, m_mask, angle, cos_sin_ptr, stride_cs, qk_scale,
        dtype, BLOCK_M, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL, DOT_DTYPE,
    )

    offs_b = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_V)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    k_head = k_buf_ptr + kvh * HEAD_DIM
    v_head = v_buf_ptr + kvh * V_DIM
    r2t = req_to_token_ptr + row * stride_r2t + key_lo
    for start_n in range(0, n_keys, BLOCK_N):
        offs_n = start_n + offs_b
        n_mask = offs_n < n_keys
        slots = tl.load(r2t + offs_n, mask=n_mask, other=0)
        m_i, l_i, acc = attend_paged_keys(
            q1, q2, q_tail, k_head, v_head, slots, n_mask, run_index + offs_n, cos_sin_ptr, stride_cs, stride_kbs,
            stride_vbs, m_i, l_i, acc, dtype, True, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL, V_DIM, BLOCK_V, DOT_DTYPE,
            DOT_PRECISION,
        )

    mid_o = mid_o_ptr + b[:, None] * stride_mob + head[:, None] * stride_moh + slot[:, None] * stride_mos
    tl.store(mid_o + offs_v[None, :], acc / l_i[:, None], mask=m_mask[:, None] & (offs_v[None, :] < V_DIM))
    tl.store(mid_lse_ptr + b * stride_mlb + head * stride_mlh + slot, m_i + tl.math.log2(l_i), mask=m_mask)


@triton.jit(do_not_specialize=["stride_mlb", "stride_mlh"])
def _merge_partials_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    counts_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ot,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (request, query head): the softmax-weighted sum of the request's partial outputs (zeros for
    a graph's padded request, which has none)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    merge_partials(
        mid_o_ptr + b * stride_mob + h * stride_moh, mid_lse_ptr + b * stride_mlb + h * stride_mlh, stride_mos,
        tl.load(counts_ptr + b).to(tl.int32), out_ptr + b * stride_ot + h * V_DIM, V_DIM, BLOCK_V,
    )


def shared_decode_kernel_params(
    num_heads: int, num_kv_heads: int, split: HeadSplit, dtype: torch.dtype, device: torch.device
) -> tuple[dict, dict]:
    """Constexprs and launch options of the attention and merge kernels (the sm_90 build test compiles these).
    Hopper: 64-key tiles, 4 warps, 3 stages, 64 query rows, the best of 13 tilings on three H200 shapes (small key
    tiles keep a chunk's keys in shared memory while several holders' queries meet them); tiny tiles for the CPU
    interpreter."""
    group = num_heads // num_kv_heads
    tiles = split.constexprs()
    if device.type != "cuda":
        block_n, warps, stages = 16, 4, 1
    elif split.head_dim <= 128 and dtype != torch.float32:
        block_n, warps, stages = 64, 4, 3
    else:
        block_n, warps, stages = 32, 4, 2
    attend = {
        "GROUP": group,
        "BLOCK_M": max(16, triton.next_power_of_2(members_per_item(group) * group)),
        "BLOCK_N": block_n,
        "DOT_DTYPE": dot_operand_dtype(dtype, device),
        "DOT_PRECISION": dot_precision(dtype),
        "num_warps": warps,
        "num_stages": stages,
        **tiles,
    }
    merge = {"V_DIM": tiles["V_DIM"], "BLOCK_V": tiles["BLOCK_V"], "num_warps": 1}
    return attend, merge


def alloc_shared_buffers(
    q: torch.Tensor, plan: SharedDecodePlan, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [B, Hq, max_partials, Dv] and their base-2 log-sum-exps, float32, for the queries q."""
    batch_size, num_heads, _ = q.shape
    mid_o = torch.empty((batch_size, num_heads, plan.max_partials, v_head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch_size, num_heads, plan.max_partials), dtype=torch.float32, device=q.device)
    return mid_o, mid_lse


def shared_decode_attention_fwd(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: PagedKV,
    plan: SharedDecodePlan,
    cos_sin_cache: torch.Tensor,
    sm_scale: float,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """out [B, Hq, Dv] for the decode queries q [B, Hq, D] (unrotated; row b of the plan's requests), keys
    position-free in kv's buffers. The plan names the rows of kv.req_to_token each request reads, so kv's own
    request rows and lengths go unread. The partials go to `buffers` (alloc_shared_buffers; allocated here if
    None)."""
    batch_size, num_heads, head_dim = q.shape
    if batch_size == 0:
        return
    k_buffer, v_buffer, req_to_token = kv.k_buffer, kv.v_buffer, kv.req_to_token
    check_dense_heads(q=q, out=out, k_buffer=k_buffer, v_buffer=v_buffer)
    num_kv_heads = k_buffer.shape[1]
    split = head_split(head_dim, cos_sin_cache, v_buffer.shape[-1])
    attend, merge = shared_decode_kernel_params(num_heads, num_kv_heads, split, q.dtype, q.device)
    if plan.members_per_item * attend["GROUP"] > attend["BLOCK_M"]:
        raise ValueError(f"the plan puts {plan.members_per_item} requests in an item; the kernel takes "
                         f"{attend['BLOCK_M'] // attend['GROUP']} (members_per_item)")
    mid_o, mid_lse = buffers or alloc_shared_buffers(q, plan, split.v_head_dim)
    _shared_decode_kernel[(plan.items.shape[0], num_kv_heads)](
        q, k_buffer, v_buffer, cos_sin_cache, req_to_token, plan.items, plan.members, plan.num_items, mid_o, mid_lse,
        sm_scale * LOG2E,
        q.stride(0), k_buffer.stride(0), v_buffer.stride(0), req_to_token.stride(0), cos_sin_cache.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        **attend,
    )
    _merge_partials_kernel[(batch_size, num_heads)](
        mid_o, mid_lse, out, plan.counts,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), out.stride(0),
        **merge,
    )
