"""Rotate-once key staging for extends: a batch's keys, gathered through req_to_token and rotated by their index
in the request, in a per-call workspace that the extend kernel then reads as pre-rotated keys.

Rotating inside the extend kernel costs a register -> shared-memory round trip per (query block, key block), which
Triton cannot overlap with the tensor-core work; staging moves each key twice instead (read, write). That pays off
when many query rows meet each key, as in every extend from 1K-token extends to 8K-token prefills. With few query
rows (a verification of 9 tokens, a cached-span prompt of 30) each key is used by one small tile, the in-kernel
round trip is cheap next to the staging pass, and small tiles rotate in-kernel faster. So the backend stages when a
request has more than FEW_QUERY_ROWS query rows and the workspace fits its bound.
The pool itself is never written: the workspace is scratch of one forward, shared position-free slots stay
untouched, and a batch too large for the bound rotates in-kernel.

The batch's new keys reach the workspace from the store kernel, which holds them in registers anyway
(store_kv(staged=...)); this pass stages only the keys already cached, so a prefill moves no key twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV
from sglang_pic.kernels.rope import HeadSplit, check_dense_heads, copy_key_rows

STAGE_MAX_BYTES = 512 * 2**20  # workspace bound: beyond it (many long contexts in one batch) keys rotate in-kernel
FEW_QUERY_ROWS = 256  # query rows (new tokens x GQA group) per request up to which keys rotate in-kernel
BLOCK_KEYS = 64


def should_stage_keys(total_keys: int, k_buffer: torch.Tensor, query_rows: int, dtype: torch.dtype) -> bool:
    """Whether an extend batch's `total_keys` (its requests' context lengths summed) are staged: when its longest
    request has more than FEW_QUERY_ROWS `query_rows` (new tokens x query heads per kv head) and the workspace,
    rows shaped like those of the layer's key buffer [slots, Hkv, D] in the queries' `dtype`, fits
    STAGE_MAX_BYTES."""
    workspace = total_keys * k_buffer[0].numel() * dtype.itemsize
    return query_rows > FEW_QUERY_ROWS and 0 < workspace <= STAGE_MAX_BYTES


def has_cached_keys(seq_lens: list[int], extend_seq_lens: list[int]) -> bool:
    """Whether an extend batch (host-side lengths) has keys the store does not write, for stage_keys to stage: a
    prefill has none."""
    return sum(seq_lens) > sum(extend_seq_lens)


@dataclass
class StagedKeys:
    """Request b's key j, rotated by j, is workspace[row_start[b] + j] ([rows, Hkv, D]). The store writes extend
    token t's key to row token_rows[t] (-1: a graph's padded row, written nowhere); stage_keys the cached keys."""

    workspace: torch.Tensor
    row_start: torch.Tensor
    token_rows: torch.Tensor


def alloc_staged_keys(kv: PagedKV, ext: ExtendRows, total_keys: int, dtype: torch.dtype) -> StagedKeys:
    """A workspace for the keys of the extends `kv` and `ext` describe (`total_keys`: their seq_lens summed, a host
    int), requests back to back, in the queries' `dtype` (keys are rotated once, into it, even from an fp8 pool),
    and the row of each of the `ext.positions.shape[0]` new tokens. Tokens past the last request's new tokens (a
    CUDA graph's padding) get row -1. Nothing synchronizes, so this may run inside a graph capture."""
    positions, starts, counts = ext.positions, ext.extend_start_loc, ext.extend_seq_lens
    row_start = torch.cumsum(kv.seq_lens, 0) - kv.seq_lens
    token = torch.arange(positions.shape[0], device=positions.device)
    request = torch.searchsorted(starts, token, right=True) - 1
    live = token < starts[-1:] + counts[-1:]
    token_rows = torch.where(live, row_start[request] + positions, -1)
    workspace = kv.k_buffer.new_empty((total_keys, *kv.k_buffer.shape[1:]), dtype=dtype)
    return StagedKeys(workspace, row_start, token_rows)


# Index tensors may be views at any offset of a batch's packed upload; their alignment is not specialized, so the
# kernel has one variant per model (see TritonAttnBackend.warm_up).
@triton.jit(
    do_not_specialize_on_alignment=[
        "req_pool_indices_ptr", "seq_lens_ptr", "ws_start_ptr", "extend_start_loc_ptr", "extend_seq_lens_ptr",
        "positions_ptr",
    ]
)
def _stage_keys_kernel(
    k_buf_ptr,
    ws_ptr,
    cos_sin_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    ws_start_ptr,
    extend_start_loc_ptr,
    extend_seq_lens_ptr,
    positions_ptr,
    stride_kbs,
    stride_ws,
    stride_r2t,
    stride_cs,
    BLOCK_J: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """Program (request b, key block, kv head): keys j of the block, rotated by j, to rows ws_start[b] + j, for the
    keys the store did not write. A request's new tokens come in increasing position order (ForwardBatch), so when
    the last is the request's last key and the first lies ext_len - 1 before it, the new keys are exactly the tail
    from the first on and only the keys before it are staged; otherwise (new span tokens between cached ones)
    every key is, the new ones again with the values the store wrote."""
    b = tl.program_id(0)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    ext_start = tl.load(extend_start_loc_ptr + b)
    ext_len = tl.load(extend_seq_lens_ptr + b)
    first_new = tl.load(positions_ptr + ext_start, mask=ext_len > 0, other=0)
    last_new = tl.load(positions_ptr + ext_start + ext_len - 1, mask=ext_len > 0, other=0)
    new_tail = (ext_len > 0) & (last_new == seq_len - 1) & (last_new - first_new + 1 == ext_len)
    stage_len = tl.where(new_tail, first_new, seq_len)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    if tl.program_id(1) * BLOCK_J >= stage_len:
        return
    j_mask = offs_j < stage_len
    slots = tl.load(req_to_token_ptr + tl.load(req_pool_indices_ptr + b) * stride_r2t + offs_j, mask=j_mask, other=0)
    src = k_buf_ptr + slots[:, None] * stride_kbs + h * HEAD_DIM
    dst = ws_ptr + (tl.load(ws_start_ptr + b) + offs_j)[:, None] * stride_ws + h * HEAD_DIM
    copy_key_rows(src, dst, j_mask, offs_j, cos_sin_ptr, stride_cs, True, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL)


def stage_kernel_params(split: HeadSplit) -> dict:
    """Constexprs and launch options of the staging kernel (the sm_90 build test compiles these)."""
    c = split.constexprs()
    keys = ("HEAD_DIM", "HALF", "BLOCK_HALF", "TAIL", "BLOCK_TAIL")
    return {"BLOCK_J": BLOCK_KEYS, "num_warps": 4, **{k: c[k] for k in keys}}


def stage_keys(staged: StagedKeys, kv: PagedKV, ext: ExtendRows, cos_sin_cache: torch.Tensor) -> StagedKeys:
    """Stage request b's cached keys (of 0..kv.seq_lens[b]-1, see _stage_keys_kernel), rotated by their index, at
    rows row_start[b] + j of `staged`, after the store has written the new ones. kv.max_seq_len, a host int
    bounding seq_lens, sizes the grid: nothing synchronizes."""
    k_buffer = kv.k_buffer
    check_dense_heads(k_buffer=k_buffer)
    _, num_kv_heads, head_dim = k_buffer.shape
    if staged.workspace.shape[0] == 0:
        return staged
    grid = (kv.req_pool_indices.shape[0], triton.cdiv(kv.max_seq_len, BLOCK_KEYS), num_kv_heads)
    _stage_keys_kernel[grid](
        k_buffer,
        staged.workspace,
        cos_sin_cache,
        kv.req_to_token,
        kv.req_pool_indices,
        kv.seq_lens,
        staged.row_start,
        ext.extend_start_loc,
        ext.extend_seq_lens,
        ext.positions,
        k_buffer.stride(0),
        staged.workspace.stride(0),
        kv.req_to_token.stride(0),
        cos_sin_cache.stride(0),
        **stage_kernel_params(HeadSplit(head_dim, cos_sin_cache.shape[-1], head_dim)),
    )
    return staged
