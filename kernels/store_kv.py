"""Fused write of new keys and values into their KV-pool slots.

The position-free engine stores keys unrotated (`store_kv`); for an extend whose keys are staged it also writes
each new key, rotated by its position, to its row of the staging workspace (kernels/stage_keys.py), so that no
second pass reads it back from the pool. `store_kv_rotated` rotates keys by their positions first, as standard
engines do; it exists only so benchmarks can price what position-free keys cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_pic.kv_cache_dtype import to_kv_dtype
from sglang_pic.kernels.rope import HeadSplit, check_dense_heads, copy_key_rows
from sglang_pic.kernels.stage_keys import StagedKeys


# The slot and position tensors may be views at any offset of a batch's packed upload: their alignment is not
# specialized, nor is the per-batch count of staged tokens, so the startup warm-up (TritonAttnBackend.warm_up)
# compiles the variants traffic uses.
@triton.jit(
    do_not_specialize=["num_staged"], do_not_specialize_on_alignment=["loc_ptr", "positions_ptr", "ws_rows_ptr"]
)
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_buf_ptr,
    v_buf_ptr,
    loc_ptr,
    positions_ptr,
    cos_sin_ptr,
    ws_ptr,
    ws_rows_ptr,
    num_staged,
    stride_kt,
    stride_vt,
    stride_kbs,
    stride_vbs,
    stride_cs,
    stride_ws,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROTATE_KEYS: tl.constexpr,
    STAGE: tl.constexpr,
):
    """One program per token: copies its [heads, dims] key and value tiles to slot loc[t]; with STAGE, tokens
    t < num_staged also write their key rotated by positions[t] to workspace row ws_rows[t] unless it is -1."""
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t)
    offs_h = tl.arange(0, BLOCK_HEADS)
    head_mask = offs_h < NUM_KV_HEADS
    k_row = k_ptr + t * stride_kt + offs_h[:, None] * HEAD_DIM
    kb_row = k_buf_ptr + slot * stride_kbs + offs_h[:, None] * HEAD_DIM
    pos = tl.zeros([BLOCK_HEADS], tl.int64) + tl.load(positions_ptr + t)
    copy_key_rows(
        k_row, kb_row, head_mask, pos, cos_sin_ptr, stride_cs, ROTATE_KEYS, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL
    )
    if STAGE:
        ws_row = tl.load(ws_rows_ptr + t, mask=t < num_staged, other=-1)
        if ws_row >= 0:
            ws_head = ws_ptr + ws_row * stride_ws + offs_h[:, None] * HEAD_DIM
            copy_key_rows(
                k_row, ws_head, head_mask, pos, cos_sin_ptr, stride_cs, True, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL
            )

    offs_v = tl.arange(0, BLOCK_V)
    v_mask = head_mask[:, None] & (offs_v[None, :] < V_DIM)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * V_DIM + offs_v[None, :], mask=v_mask, other=0.0)
    vb_ptrs = v_buf_ptr + slot * stride_vbs + offs_h[:, None] * V_DIM + offs_v[None, :]
    tl.store(vb_ptrs, v.to(v_buf_ptr.dtype.element_ty), mask=v_mask)


def store_kernel_params(num_kv_heads: int, split: HeadSplit, rotate: bool, stage: bool = False) -> dict:
    """Constexprs and launch options of the store kernel (the sm_90 build test compiles these)."""
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "BLOCK_HEADS": triton.next_power_of_2(num_kv_heads),
        "ROTATE_KEYS": rotate,
        "STAGE": stage,
        "num_warps": 1 if num_kv_heads * split.head_dim <= 512 else 4,
        **split.constexprs(),
    }


def _launch(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotate: bool,
    staged: StagedKeys | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    check_dense_heads(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer)
    if num_tokens == 0:
        return
    if k_buffer.dtype != k.dtype:  # rounded here, so the kernel copies bytes (see kv_cache_dtype.py)
        if rotate:
            raise ValueError("the pre-rotated baseline store rounds keys after rotating: pass k in the pool's dtype")
        k, v = to_kv_dtype(k, k_buffer.dtype), to_kv_dtype(v, v_buffer.dtype)
    split = HeadSplit(head_dim, cos_sin_cache.shape[-1], v.shape[-1])
    ws, ws_rows = (staged.workspace, staged.token_rows) if staged is not None else (k_buffer, loc)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        positions,
        cos_sin_cache,
        ws,
        ws_rows,
        ws_rows.shape[0] if staged is not None else 0,
        k.stride(0),
        v.stride(0),
        k_buffer.stride(0),
        v_buffer.stride(0),
        cos_sin_cache.stride(0),
        ws.stride(0),
        **store_kernel_params(num_kv_heads, split, rotate, staged is not None),
    )


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    staged: StagedKeys | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """k_buffer[loc] = k, v_buffer[loc] = v, k/v [T, Hkv, D] unrotated (rounded to an fp8 pool's dtype). With
    `staged`, the first len(staged.token_rows) tokens' keys also go, rotated by `positions` (cos_sin_cache in the
    workspace's dtype, as stage_keys gets it), from the values the pool keeps to their workspace rows; else
    cos_sin_cache only sizes the rotary tiles."""
    if staged is not None and positions is None:
        raise ValueError("store_kv needs the new tokens' positions to stage their keys")
    _launch(k_buffer, v_buffer, loc, k, v, loc if positions is None else positions, cos_sin_cache, False, staged)


def store_kv_rotated(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Baseline store: keys rotated by `positions` before they are written (what standard engines keep)."""
    _launch(k_buffer, v_buffer, loc, k, v, positions, cos_sin_cache, rotate=True)
