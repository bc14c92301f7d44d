"""Rotate-once key staging for extends: a batch's keys, gathered through req_to_token and rotated by their index
in the request, in a per-call workspace that the extend kernel then reads as pre-rotated keys.

Rotating inside the extend kernel costs a register -> shared-memory round trip per (query block, key block), which
Triton cannot overlap with the tensor-core work; staging moves each key twice instead (read, write). That pays off
when many query rows meet each key: on the H200 staging was as fast or faster for every extend shape from 1K-token
extends to 8K-token prefills (benchmark/results/attention_kernels_h200.log). With few query rows (a verification
of 9 tokens, a cached-span prompt of 30) each key is used by one small tile, the in-kernel round trip is cheap next
to the staging pass, and small tiles rotate in-kernel faster (benchmark/results/few_query_extend_h200.log). So the
backend stages when a request has more than FEW_QUERY_ROWS query rows and the workspace fits its bound.
The pool itself is never written: the workspace is scratch of one attention call, shared position-free slots stay
untouched, and a batch too large for the bound rotates in-kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_pic.kernels.rope import HeadSplit, check_dense_heads, copy_key_rows

STAGE_MAX_BYTES = 512 * 2**20  # workspace bound: beyond it (many long contexts in one batch) keys rotate in-kernel
FEW_QUERY_ROWS = 256  # query rows (new tokens x GQA group) per request up to which keys rotate in-kernel
BLOCK_KEYS = 64


def should_stage_keys(total_keys: int, k_buffer: torch.Tensor, query_rows: int) -> bool:
    """Whether an extend batch's `total_keys` (its requests' context lengths summed) are staged: when its longest
    request has more than FEW_QUERY_ROWS `query_rows` (new tokens x query heads per kv head) and the workspace,
    rows like those of the layer's key buffer [slots, Hkv, D], fits STAGE_MAX_BYTES."""
    workspace = total_keys * k_buffer[0].numel() * k_buffer.element_size()
    return query_rows > FEW_QUERY_ROWS and 0 < workspace <= STAGE_MAX_BYTES


def key_row_starts(seq_lens: torch.Tensor) -> torch.Tensor:
    """Workspace row of each request's key 0: requests are staged back to back (computed once per batch)."""
    return torch.cumsum(seq_lens, 0) - seq_lens


@dataclass
class StagedKeys:
    """Request b's key j, rotated by j, is workspace[row_start[b] + j] ([rows, Hkv, D])."""

    workspace: torch.Tensor
    row_start: torch.Tensor


# Index tensors may be views at any offset of a batch's packed upload; their alignment is not specialized, so the
# kernel has one variant per model (see TritonAttnBackend.warm_up).
@triton.jit(do_not_specialize_on_alignment=["req_pool_indices_ptr", "seq_lens_ptr", "ws_start_ptr"])
def _stage_keys_kernel(
    k_buf_ptr,
    ws_ptr,
    cos_sin_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    ws_start_ptr,
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
    """Program (request b, key block, kv head): keys j of the block, rotated by j, to rows ws_start[b] + j."""
    b = tl.program_id(0)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    if tl.program_id(1) * BLOCK_J >= seq_len:
        return
    j_mask = offs_j < seq_len
    slots = tl.load(req_to_token_ptr + tl.load(req_pool_indices_ptr + b) * stride_r2t + offs_j, mask=j_mask, other=0)
    src = k_buf_ptr + slots[:, None] * stride_kbs + h * HEAD_DIM
    dst = ws_ptr + (tl.load(ws_start_ptr + b) + offs_j)[:, None] * stride_ws + h * HEAD_DIM
    copy_key_rows(src, dst, j_mask, offs_j, cos_sin_ptr, stride_cs, True, HALF, BLOCK_HALF, TAIL, BLOCK_TAIL)


def stage_kernel_params(split: HeadSplit) -> dict:
    """Constexprs and launch options of the staging kernel (the sm_90 build test compiles these)."""
    c = split.constexprs()
    keys = ("HEAD_DIM", "HALF", "BLOCK_HALF", "TAIL", "BLOCK_TAIL")
    return {"BLOCK_J": BLOCK_KEYS, "num_warps": 4, **{k: c[k] for k in keys}}


def stage_keys(
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    row_start: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    total_keys: int,
    max_seq_len: int,
) -> StagedKeys:
    """Request b's keys 0..seq_lens[b]-1, rotated by their index, staged at rows row_start[b] + j (row_start from
    key_row_starts). `total_keys` (the sum of seq_lens) and `max_seq_len` are host ints: nothing synchronizes."""
    check_dense_heads(k_buffer=k_buffer)
    _, num_kv_heads, head_dim = k_buffer.shape
    workspace = k_buffer.new_empty((total_keys, num_kv_heads, head_dim))
    if total_keys == 0:
        return StagedKeys(workspace, row_start)
    grid = (req_pool_indices.shape[0], triton.cdiv(max_seq_len, BLOCK_KEYS), num_kv_heads)
    _stage_keys_kernel[grid](
        k_buffer,
        workspace,
        cos_sin_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        row_start,
        k_buffer.stride(0),
        workspace.stride(0),
        req_to_token.stride(0),
        cos_sin_cache.stride(0),
        **stage_kernel_params(HeadSplit(head_dim, cos_sin_cache.shape[-1], head_dim)),
    )
    return StagedKeys(workspace, row_start)
