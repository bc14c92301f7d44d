"""Position-free paged attention in plain torch: the CPU path and the reference for the Triton kernels.

Keys are read unrotated from the pool through req_to_token and rotated by their logical index j; queries are
rotated by their own positions. Query t of request b sees keys j with attn_lo[t] <= j <= positions[t].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_pic.kv_cache_dtype import to_kv_dtype
from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV, SpanScaling


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., H, D] by positions [...] in float32 (neox rotate_half form; cos|sin halves in the cache)."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf[..., : rot // 2], xf[..., rot // 2 : rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rot:]], dim=-1)


def store_kv_torch(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    k_buffer[loc] = to_kv_dtype(k, k_buffer.dtype)
    v_buffer[loc] = to_kv_dtype(v, v_buffer.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D] unrotated
    kv: PagedKV,
    ext: ExtendRows,
    cos_sin_cache: torch.Tensor,  # [P, rotary_dim]
    sm_scale: float,
    keys_rotated: bool = False,
    out: torch.Tensor | None = None,
    span: SpanScaling | None = None,
    requests: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched masked attention for extend and decode alike, each request's queries padded to ext.max_extend_len
    and keys to kv.max_seq_len (the true maximum when 0, which reads it from the device). Returns [T, Hq, Dv]
    in q's dtype: `out` when given, with the rows of these requests written (callers attend groups of a batch's
    requests into one output).

    keys_rotated=True reads keys that were stored already rotated (the baseline engines use); then only
    queries are rotated here. `span` scales the attention to span keys (see SpanScaling), whose request b is request
    requests[b] of `span` (default: b).
    """
    T, hq, d = q.shape
    k_buffer, v_buffer, seq_lens = kv.k_buffer, kv.v_buffer, kv.seq_lens
    hkv = k_buffer.shape[1]
    group = hq // hkv
    bsz = kv.req_pool_indices.shape[0]
    device = q.device
    max_q = ext.max_extend_len
    max_kv = kv.max_seq_len or int(seq_lens.max())

    # Gather each request's keys and values, padded to max_kv.
    kv_idx = torch.arange(max_kv, device=device)
    kv_valid = kv_idx[None, :] < seq_lens[:, None]  # [B, K]
    slots = kv.req_to_token[kv.req_pool_indices][:, :max_kv]
    slots = torch.where(kv_valid, slots, torch.zeros_like(slots))
    keys = k_buffer[slots]  # [B, K, Hkv, D]
    if keys_rotated:
        keys = keys.float()
    else:
        keys = rope_rotate(keys, kv_idx[None, :].expand(bsz, max_kv), cos_sin_cache)
    values = v_buffer[slots].float()

    # Scatter each request's queries into [B, Q] rows.
    q_off = torch.arange(max_q, device=device)
    q_valid = q_off[None, :] < ext.extend_seq_lens[:, None]  # [B, Q]
    zero = torch.zeros_like(q_valid, dtype=torch.long)
    rows = torch.where(q_valid, ext.extend_start_loc[:, None] + q_off[None, :], zero)
    q_pos = ext.positions[rows]
    q_lo = ext.attn_lo[rows]
    q_rot = rope_rotate(q[rows], q_pos, cos_sin_cache)  # [B, Q, Hq, D]

    visible = (kv_idx[None, None, :] <= q_pos[:, :, None]) & (kv_idx[None, None, :] >= q_lo[:, :, None])
    visible &= kv_valid[:, None, :] & q_valid[:, :, None]
    visible[:, :, 0] |= ~q_valid  # padded query rows see one key so softmax stays finite

    # [B, Hkv, group*Q, D] against [B, Hkv, K, D]
    qh = q_rot.view(bsz, max_q, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, group * max_q, d)
    kh = keys.permute(0, 2, 1, 3)
    vh = values.permute(0, 2, 1, 3)
    mask = visible[:, None, None, :, :].expand(bsz, hkv, group, max_q, max_kv).reshape(bsz, hkv, group * max_q, max_kv)
    if span is None:
        attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=sm_scale)
    else:
        logits = _span_scaled_logits(qh, kh, mask, sm_scale, span, requests, q_pos, kv_idx, group)
        attn = torch.matmul(torch.softmax(logits, dim=-1), vh)
    dv = attn.shape[-1]
    attn = attn.view(bsz, hkv, group, max_q, dv).permute(0, 3, 1, 2, 4).reshape(bsz, max_q, hq, dv)
    result = torch.empty((T, hq, dv), dtype=q.dtype, device=device) if out is None else out
    result[rows[q_valid]] = attn[q_valid].to(q.dtype)
    return result


def _span_scaled_logits(
    qh: torch.Tensor,  # [B, Hkv, G*Q, D]
    kh: torch.Tensor,  # [B, Hkv, K, D]
    mask: torch.Tensor,  # [B, Hkv, G*Q, K] visible keys
    sm_scale: float,
    span: SpanScaling,
    requests: torch.Tensor | None,
    q_pos: torch.Tensor,  # [B, Q]
    kv_idx: torch.Tensor,  # [K]
    group: int,
) -> torch.Tensor:
    """Masked logits with APE's scaling of span keys (SpanScaling): a key's logit x in a span group becomes
    x / T + (S * T - 1) * LSE, LSE the log-sum-exp of the row's visible tempered logits of that group, so that the
    group weighs exp(S * T * LSE) against the other keys; rows of queries inside a span keep plain logits."""
    bsz = qh.shape[0]
    b = torch.arange(bsz, device=qh.device) if requests is None else requests
    keys = kv_idx[None, :].expand(bsz, -1)
    row_scaled = ~span.in_spans(q_pos, b)  # [B, Q]
    row_scaled = row_scaled[:, None, None, :].expand(-1, 1, group, -1).reshape(bsz, 1, -1, 1)
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * sm_scale
    scaled = logits
    for g in range(span.num_groups):
        temp, scale = (f[:, None, None, None] for f in span.group_factors(g, b))
        key_group = span.in_spans(keys, b, g)[:, None, None, :]  # [B, 1, 1, K]
        tempered = logits / temp
        lse = torch.logsumexp(tempered.masked_fill(~(mask & key_group), float("-inf")), dim=-1, keepdim=True)
        bias = torch.where(torch.isfinite(lse), (scale * temp - 1) * lse, torch.zeros_like(lse))
        scaled = torch.where(key_group & row_scaled, tempered + bias, scaled)
    return scaled.masked_fill(~mask, float("-inf"))
