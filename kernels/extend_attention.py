"""Triton extend (prefill) attention over the paged KV pool with in-kernel RoPE.

Each request's new tokens are rows extend_start_loc[b] .. + extend_seq_lens[b] of q, with explicit positions and
attn_lo: the query at position p sees keys j in [attn_lo, p], read through req_to_token and rotated by j.

One program owns one kv head and a block of BLOCK_M rows made of BLOCK_M // GROUP tokens times the GROUP query
heads that share the kv head, so every key tile is loaded and rotated once per GQA group rather than once per
query head. Key blocks wholly outside [min attn_lo, max position] of the query block are never visited.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV, SpanScaling
from sglang_pic.kernels.rope import (
    HeadSplit,
    attend_block,
    check_dense_heads,
    dot_operand_dtype,
    dot_precision,
    head_split,
    key_scores,
    load_cos_sin,
    merge_partials,
    rotate_halves,
    rotate_keys,
)
from sglang_pic.kernels.stage_keys import FEW_QUERY_ROWS, StagedKeys

LOG2E = 1.0 / math.log(2.0)
MAX_SPLITS = 32
MIN_SPLIT_KEYS = 512  # a chunk shorter than this is not worth a program of its own
SHORT_CONTEXT_KEYS = 1024  # a batch whose longest context is at most this many keys gets the small tile


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int  # query rows (tokens x group heads) per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


def default_extend_config(
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    keys_rotated: bool = False,
    query_rows: int = 0,
    max_keys: int = 0,
) -> ExtendConfig:
    """Tiles for Hopper-class GPUs, free of register spills for head_dim 64..256 in sm_90 builds by Triton 3.6
    and 3.9; small tiles on CPU so the interpreter walks several blocks on small tests. The pre-rotated baseline
    gets its own best tile, so the comparison is between the best of each. `query_rows` (the longest request's
    new tokens x GQA group; 0 when unknown) picks smaller tiles for few-query extends, whose large tiles would be
    mostly padding (on the H200, 9 tokens x 32 requests over 16K keys run 3.5x faster in them); up to 128 rows,
    two 64-row blocks beat one of 128, since more programs share the key range. `max_keys` (the longest context;
    0 when unknown) up to SHORT_CONTEXT_KEYS picks the small tile too: short causal prefills lose less of each
    diagonal block in it (on the H200, 8 prefills of 1K run 6% faster; one of 8K 5% slower)."""
    if device.type != "cuda":
        return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # exact fp32 products run on CUDA cores and need small tiles
        return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
    if head_dim <= 128:  # best of the H200 tile sweeps (benchmark/results/kernels_sweep_h200.json)
        few = 0 < query_rows <= FEW_QUERY_ROWS
        if (few and query_rows <= 128) or 0 < max_keys <= SHORT_CONTEXT_KEYS:
            return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
        if keys_rotated or few:
            return ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
        return ExtendConfig(block_m=256, block_n=64, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def extend_variants(
    group: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[int, int, bool, int]]:
    """(new tokens of one request, its context, keys staged, key-range splits) of one launch per extend kernel
    variant the backend can pick for position-free keys: each tile of default_extend_config (tiles change with the
    query rows only up to FEW_QUERY_ROWS + 1, and with the context only at SHORT_CONTEXT_KEYS) with keys rotated
    in-kernel or, past FEW_QUERY_ROWS rows, staged, each with the key range whole or split (the SPLIT constexpr)."""
    seen: set[tuple[ExtendConfig, bool]] = set()
    variants = []
    for tokens in range(1, FEW_QUERY_ROWS // group + 2):
        many = tokens * group > FEW_QUERY_ROWS
        for keys in (tokens, max(tokens, SHORT_CONTEXT_KEYS + 1)):
            tile = (default_extend_config(head_dim, dtype, device, False, tokens * group, keys), many)
            if tile not in seen:
                seen.add(tile)
                stagings = (False, True) if many else (False,)
                variants += [(tokens, keys, staged, splits) for staged in stagings for splits in (1, 2)]
    return variants


# Per-batch integers and index pointers (views at any offset of a batch's packed upload) are not specialized: the
# variants then depend only on the model and the tile choice, and TritonAttnBackend.warm_up compiles them at startup.
# Row strides that are multiples of head_dim stay specialized (the H200 prefill lost up to a third without): they
# are divisible by 16 in traffic and warm-up alike for every head_dim that is.
@triton.jit(
    do_not_specialize=["num_splits", "stride_mlt", "span_group", "group_stride"],
    do_not_specialize_on_alignment=[
        "req_pool_indices_ptr", "extend_start_loc_ptr", "extend_seq_lens_ptr", "positions_ptr", "attn_lo_ptr",
        "key_row_start_ptr", "span_ranges_ptr", "span_range_start_ptr", "span_group_ptr", "span_temp_ptr",
        "span_scale_ptr", "span_lse_ptr",
    ],
)
def _extend_attention_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    cos_sin_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    extend_start_loc_ptr,
    extend_seq_lens_ptr,
    positions_ptr,
    attn_lo_ptr,
    key_row_start_ptr,
    span_ranges_ptr,
    span_range_start_ptr,
    span_group_ptr,
    span_temp_ptr,
    span_scale_ptr,
    span_lse_ptr,
    span_group,
    group_stride,
    qk_scale,
    num_positions,
    num_splits,
    stride_qt,
    stride_ot,
    stride_mot,
    stride_mlt,
    stride_kbs,
    stride_vbs,
    stride_r2t,
    stride_cs,
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
    ROTATE_KEYS: tl.constexpr,
    KEYS_STAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPAN_PASS: tl.constexpr,
):
    """SPAN_PASS (APE's scaling of span keys, see SpanScaling) 0: plain attention; 1: only the log-sum-exp of each
    scaled row's tempered logits of its span group `span_group`, per key chunk, into span_lse [T, Hq, splits];
    2: attention with each group's logits tempered and shifted by (S * T - 1) times the group's log-sum-exp, read
    from span_lse [groups, T, Hq] (group_stride apart)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    # The last query blocks of a causal request see the most keys: they take the lowest ids of the slowest grid
    # axis, so the GPU starts them first and the light blocks fill the tail of the wave.
    work_id = tl.num_programs(2) - 1 - tl.program_id(2)
    q_block = work_id // num_splits
    chunk_id = work_id % num_splits
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    ext_len = tl.load(extend_seq_lens_ptr + b)
    if q_block * TOKENS >= ext_len:
        return
    ext_start = tl.load(extend_start_loc_ptr + b)
    req_row = tl.load(req_pool_indices_ptr + b)
    dtype = q_ptr.dtype.element_ty  # the pool (v_buf, and k_buf unless staged) may be fp8: tiles widen on load

    # Row r of the block is token r // GROUP of this program, query head kvh * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * TOKENS + offs_m // GROUP
    row_mask = (offs_m < TOKENS * GROUP) & (tok < ext_len)
    row = ext_start + tok
    head = kvh * GROUP + offs_m % GROUP
    pos = tl.load(positions_ptr + row, mask=row_mask, other=-1).to(tl.int32)
    lo = tl.load(attn_lo_ptr + row, mask=row_mask, other=0).to(tl.int32)
    kv_hi = tl.max(pos, 0) + 1
    kv_lo = tl.min(tl.where(row_mask, lo, kv_hi), 0)
    if SPAN_PASS > 0:
        r_first = tl.load(span_range_start_ptr + b)
        r_last = tl.load(span_range_start_ptr + b + 1)
        row_in_span = tl.zeros([BLOCK_M], tl.int32)
        for r in range(r_first, r_last):
            s_lo = tl.load(span_ranges_ptr + 2 * r)
            s_hi = tl.load(span_ranges_ptr + 2 * r + 1)
            row_in_span |= ((pos >= s_lo) & (pos < s_hi)).to(tl.int32)
        row_scaled = row_mask & (row_in_span == 0)
        lse_rows = span_lse_ptr + row * (stride_mlt // num_splits) + head  # pass 2: the groups' [T, Hq] planes

    # Queries: rotate by their own positions and fold in the softmax scale (base-2 exponent).
    offs_r = tl.arange(0, BLOCK_HALF)
    q_rows = q_ptr + row[:, None] * stride_qt + head[:, None] * HEAD_DIM
    q_mask = row_mask[:, None] & (offs_r[None, :] < HALF)
    q1 = tl.load(q_rows + offs_r[None, :], mask=q_mask, other=0.0)
    q2 = tl.load(q_rows + HALF + offs_r[None, :], mask=q_mask, other=0.0)
    cos, sin = load_cos_sin(cos_sin_ptr, stride_cs, pos, offs_r, row_mask, HALF)
    q1, q2 = rotate_halves(q1, q2, cos, sin)
    q1 = (q1 * qk_scale).to(dtype).to(DOT_DTYPE)
    q2 = (q2 * qk_scale).to(dtype).to(DOT_DTYPE)
    offs_t = tl.arange(0, BLOCK_TAIL)
    q_tail = tl.zeros([BLOCK_M, BLOCK_TAIL], DOT_DTYPE)  # no tail: key_scores skips it
    if TAIL > 0:
        tail_mask = row_mask[:, None] & (offs_t[None, :] < TAIL)
        q_tail = tl.load(q_rows + 2 * HALF + offs_t[None, :], mask=tail_mask, other=0.0)
        q_tail = (q_tail.to(tl.float32) * qk_scale).to(dtype).to(DOT_DTYPE)

    offs_v = tl.arange(0, BLOCK_V)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite, so fully masked rows never produce inf - inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    k_head = k_buf_ptr + kvh * HEAD_DIM
    if KEYS_STAGED:  # k_buf is a staging workspace: key j of this request is row key_row_start[b] + j
        k_head += tl.load(key_row_start_ptr + b) * stride_kbs
    v_head = v_buf_ptr + kvh * V_DIM
    r2t_row = req_to_token_ptr + req_row * stride_r2t
    offs_b = tl.arange(0, BLOCK_N)
    half_mask = offs_r < HALF

    first = kv_lo // BLOCK_N * BLOCK_N
    per_chunk = tl.cdiv(tl.cdiv(kv_hi - first, BLOCK_N), num_splits) * BLOCK_N
    first = first + chunk_id * per_chunk
    last = tl.minimum(kv_hi, first + per_chunk)

    # Each block's slots are loaded one iteration ahead. Loaded in the iteration that uses them, they make the key
    # and value loads a load-to-load chain that Triton's pipeliner gives one buffer, so those loads waited for the
    # previous block's math; as loop-carried values they leave the loads num_stages - 1 buffers.
    next_slots = tl.load(r2t_row + first + offs_b, mask=first + offs_b < kv_hi, other=0)
    for start_n in range(first, last, BLOCK_N):
        offs_n = start_n + offs_b
        n_mask = offs_n < kv_hi
        slots = next_slots
        next_n = offs_n + BLOCK_N
        next_slots = tl.load(r2t_row + next_n, mask=next_n < kv_hi, other=0)
        if KEYS_STAGED:
            k_rows = k_head + offs_n[:, None] * stride_kbs
        else:
            k_rows = k_head + slots[:, None] * stride_kbs
        k_mask = n_mask[:, None] & (offs_r[None, :] < HALF)
        k1 = tl.load(k_rows + offs_r[None, :], mask=k_mask, other=0.0).to(dtype)
        k2 = tl.load(k_rows + HALF + offs_r[None, :], mask=k_mask, other=0.0).to(dtype)
        if ROTATE_KEYS:
            t_cos, t_sin = load_cos_sin(cos_sin_ptr, stride_cs, offs_b, offs_r, offs_b < num_positions, HALF)
            base = cos_sin_ptr + start_n * stride_cs + offs_r
            b_cos = tl.load(base, mask=half_mask, other=1.0)[None, :]
            b_sin = tl.load(base + HALF, mask=half_mask, other=0.0)[None, :]
            k_cos = b_cos * t_cos - b_sin * t_sin
            k_sin = b_sin * t_cos + b_cos * t_sin
            k1, k2 = rotate_keys(k1, k2, k_cos, k_sin)
        qk = key_scores(q1, q2, q_tail, k1, k2, k_rows, n_mask, dtype, HALF, TAIL, BLOCK_TAIL, DOT_DTYPE, DOT_PRECISION)

        visible = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= pos[:, None])
        if SPAN_PASS > 0:
            key_in_span = tl.zeros([BLOCK_N], tl.int32)
            key_inv_temp = tl.full([BLOCK_N], 1.0, tl.float32)
            shift = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for r in range(r_first, r_last):
                s_lo = tl.load(span_ranges_ptr + 2 * r)
                s_hi = tl.load(span_ranges_ptr + 2 * r + 1)
                g = tl.load(span_group_ptr + r)
                # Only the few ranges that overlap this key block (of one group, in a first pass) cost tile work.
                overlaps = (s_lo < start_n + BLOCK_N) & (s_hi > start_n)
                if SPAN_PASS == 1:
                    overlaps = overlaps & (g == span_group)
                if overlaps:
                    in_r = (offs_n >= s_lo) & (offs_n < s_hi)
                    temp = tl.load(span_temp_ptr + r)
                    key_in_span |= in_r.to(tl.int32)
                    key_inv_temp = tl.where(in_r, 1.0 / temp, key_inv_temp)
                    if SPAN_PASS == 2:
                        group_lse = tl.load(lse_rows + g * group_stride, mask=row_scaled, other=0.0)
                        shift_r = (tl.load(span_scale_ptr + r) * temp - 1.0) * group_lse
                        shift = tl.where(in_r[None, :], shift_r[:, None], shift)
            span_key = row_scaled[:, None] & (key_in_span != 0)[None, :]
            if SPAN_PASS == 1:
                visible = visible & span_key
            if SPAN_PASS == 2:
                qk = tl.where(span_key, qk * key_inv_temp[None, :] + shift, qk)
            else:  # a first pass has no shifts yet: its zero tile is dropped
                qk = tl.where(span_key, qk * key_inv_temp[None, :], qk)
        qk = tl.where(visible, qk, float("-inf"))
        if SPAN_PASS == 1:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(qk - m_new[:, None]), 1)
            m_i = m_new
        else:
            v_mask = n_mask[:, None] & (offs_v[None, :] < V_DIM)
            v = tl.load(v_head + slots[:, None] * stride_vbs + offs_v[None, :], mask=v_mask, other=0.0).to(dtype)
            m_i, l_i, acc = attend_block(qk, v, m_i, l_i, acc, DOT_DTYPE, DOT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_mask = row_mask[:, None] & (offs_v[None, :] < V_DIM)
    if SPAN_PASS == 1:
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_i), float("-inf"))
        tl.store(span_lse_ptr + row * stride_mlt + head * num_splits + chunk_id, lse, mask=row_mask)
    elif SPLIT:
        mid_row = row * stride_mot + head * (num_splits * V_DIM) + chunk_id * V_DIM
        tl.store(mid_o_ptr + mid_row[:, None] + offs_v[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_i), float("-inf"))
        tl.store(mid_lse_ptr + row * stride_mlt + head * num_splits + chunk_id, lse, mask=row_mask)
    else:
        out_ptrs = out_ptr + row[:, None] * stride_ot + head[:, None] * V_DIM + offs_v[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_mlt"])
def _extend_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    num_splits,
    stride_mot,
    stride_mlt,
    stride_ot,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (token, query head): the chunks' outputs weighted by their softmax mass. A chunk that saw
    no visible key has log-sum-exp -inf and weight 0; every query sees at least itself, so some chunk counts."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    merge_partials(
        mid_o_ptr + t * stride_mot + h * num_splits * V_DIM, mid_lse_ptr + t * stride_mlt + h * num_splits, V_DIM,
        num_splits, out_ptr + t * stride_ot + h * V_DIM, V_DIM, BLOCK_V,
    )


def num_extend_splits(programs: int, max_seq_len: int, num_sms: int, num_warps: int) -> int:
    """Key-range chunks per query block so that the programs fill one wave of the GPU, as far as the context gives
    each chunk MIN_SPLIT_KEYS keys; 1 (no merge pass) when the query blocks fill it already. A wave is two programs
    per SM for 4-warp tiles and one for the larger 8-warp ones. More chunks only add programs that wait and merge
    work (on the H200, 60 tokens over 16K keys take 13% longer in 16 chunks than in the 8 that fill one wave)."""
    wave = num_sms * (2 if num_warps <= 4 else 1)
    return max(1, min(MAX_SPLITS, wave // programs, max_seq_len // MIN_SPLIT_KEYS))


def extend_kernel_params(
    num_heads: int,
    num_kv_heads: int,
    split: HeadSplit,
    dtype: torch.dtype,
    device: torch.device,
    keys_rotated: bool,
    config: ExtendConfig | None = None,
    split_keys: bool = False,
    keys_staged: bool = False,
    max_extend_len: int = 0,
    max_keys: int = 0,
) -> dict:
    """Constexprs and launch options of the extend kernel (the sm_90 build test compiles exactly these).
    Staged keys (see stage_keys) are rotated already, so they get the pre-rotated tiles."""
    group = num_heads // num_kv_heads
    rotated = keys_rotated or keys_staged
    cfg = config or default_extend_config(split.head_dim, dtype, device, rotated, max_extend_len * group, max_keys)
    return {
        "GROUP": group,
        "BLOCK_M": max(cfg.block_m, triton.next_power_of_2(group)),
        "BLOCK_N": cfg.block_n,
        "ROTATE_KEYS": not rotated,
        "KEYS_STAGED": keys_staged,
        "SPLIT": split_keys,
        "SPAN_PASS": 0,
        "DOT_DTYPE": dot_operand_dtype(dtype, device),
        "DOT_PRECISION": dot_precision(dtype),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **split.constexprs(),
    }


def extend_attention_fwd(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: PagedKV,
    ext: ExtendRows,
    cos_sin_cache: torch.Tensor,
    sm_scale: float,
    *,
    keys_rotated: bool = False,
    config: ExtendConfig | None = None,
    num_splits: int | None = None,
    num_sms: int = 1,
    staged_keys: StagedKeys | None = None,
    span: SpanScaling | None = None,
) -> None:
    """out [T, Hq, Dv] = attention of q [T, Hq, D] (unrotated, rows as `ext` lays them out) over `kv`.

    The key range is cut into `num_splits` chunks (default: `num_extend_splits` from the longest context,
    kv.max_seq_len, and the device's `num_sms`). ext.max_extend_len sizes the grid; it may exceed the true maximum.

    Keys are rotated in the dtype of `cos_sin_cache` (pass it in q's dtype, see RotaryEmbedding.kernel_table); the
    pool may hold keys and values in fp8. keys_rotated=True is the baseline: the pool holds keys already rotated by
    their position, so only queries are rotated. With `staged_keys` (from stage_keys over the same requests) keys
    are read, rotated, from its workspace instead of kv.k_buffer; values still come from the pool. `span` (over the
    same requests) scales the attention to span keys: a pass of the kernel per span group takes each row's
    log-sum-exp of that group, then the last pass attends.
    """
    num_tokens, num_heads, head_dim = q.shape
    max_extend_len, k_buffer, v_buffer = ext.max_extend_len, kv.k_buffer, kv.v_buffer
    if num_tokens == 0 or max_extend_len == 0:
        return
    check_dense_heads(q=q, out=out, k_buffer=k_buffer, v_buffer=v_buffer)
    num_kv_heads = k_buffer.shape[1]
    split = head_split(head_dim, cos_sin_cache, v_buffer.shape[-1])
    staged = staged_keys is not None
    if staged:
        k_buffer = staged_keys.workspace
    params = extend_kernel_params(
        num_heads, num_kv_heads, split, q.dtype, q.device, keys_rotated, config, keys_staged=staged,
        max_extend_len=max_extend_len, max_keys=kv.max_seq_len,
    )
    q_blocks = triton.cdiv(max_extend_len, params["BLOCK_M"] // params["GROUP"])
    if num_splits is None:
        programs = kv.req_pool_indices.shape[0] * num_kv_heads * q_blocks
        num_splits = num_extend_splits(programs, kv.max_seq_len, num_sms, params["num_warps"])
    params["SPLIT"] = num_splits > 1
    v_dim = v_buffer.shape[-1]
    mid_o = q.new_empty((num_tokens, num_heads, num_splits, v_dim) if num_splits > 1 else (0,), dtype=torch.float32)
    mid_lse = q.new_empty((num_tokens, num_heads, num_splits) if num_splits > 1 else (0,), dtype=torch.float32)
    grid = (kv.req_pool_indices.shape[0], num_kv_heads, q_blocks * num_splits)
    launch = functools.partial(_launch_extend, grid, q, k_buffer, v_buffer, out, mid_o, mid_lse, cos_sin_cache, kv,
                               ext, staged_keys, sm_scale=sm_scale, num_splits=num_splits, num_heads=num_heads,
                               v_dim=v_dim)
    if span is None:
        launch([kv.req_pool_indices] * 5 + [mid_lse, 0, 0], params={**params, "SPAN_PASS": 0})  # unused pointers
    else:
        pointers = [span.ranges, span.range_start, span.group, span.temperature, span.scale]
        span_lse = q.new_empty((span.num_groups, num_tokens, num_heads, num_splits), dtype=torch.float32)
        for g in range(span.num_groups):
            launch([*pointers, span_lse[g], g, 0], params={**params, "SPAN_PASS": 1})
        # Each group's log-sum-exp over the key chunks (base 2); 0 for a row that sees none of its keys.
        group_lse = torch.logsumexp(span_lse * math.log(2), -1) / math.log(2)
        group_lse = torch.where(torch.isfinite(group_lse), group_lse, 0.0)
        launch([*pointers, group_lse, 0, num_tokens * num_heads], params={**params, "SPAN_PASS": 2})
    if num_splits > 1:
        _extend_merge_kernel[(num_tokens, num_heads)](
            mid_o,
            mid_lse,
            out,
            num_splits,
            num_heads * num_splits * v_dim,
            num_heads * num_splits,
            out.stride(0),
            V_DIM=v_dim,
            BLOCK_V=params["BLOCK_V"],
            num_warps=1,
        )


def _launch_extend(grid, q, k_buffer, v_buffer, out, mid_o, mid_lse, cos_sin_cache, kv, ext, staged_keys, span_args,
                   sm_scale, num_splits, num_heads, v_dim, params) -> None:
    """One launch of the extend kernel (extend_attention_fwd's arguments; `span_args`: its six span pointers, the
    span group of a first pass and the groups' stride of a second)."""
    staged = staged_keys is not None
    _extend_attention_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        mid_o,
        mid_lse,
        cos_sin_cache,
        kv.req_to_token,
        kv.req_pool_indices,
        ext.extend_start_loc,
        ext.extend_seq_lens,
        ext.positions,
        ext.attn_lo,
        staged_keys.row_start if staged else kv.req_pool_indices,  # any int64 pointer when unused
        *span_args,
        sm_scale * LOG2E,
        cos_sin_cache.shape[0],
        num_splits,
        q.stride(0),
        out.stride(0),
        num_heads * num_splits * v_dim,
        num_heads * num_splits,
        k_buffer.stride(0),
        v_buffer.stride(0),
        kv.req_to_token.stride(0),
        cos_sin_cache.stride(0),
        **params,
    )
