"""Float64 dense attention over the paged pool, written independently of torch_native.py, for kernel tests.

It walks requests one by one and queries in chunks (bounded memory at 32K contexts), builds each request's
visible-key mask from positions and attn_lo, and applies RoPE in float64 from the same cos/sin table.
"""

from __future__ import annotations

import torch

from sglang_pic.kv_cache_dtype import to_kv_dtype
from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV, SpanScaling

QUERY_CHUNK = 512


def rope_f64(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by positions [N] in float64 (neox form; dims past the table's width stay put)."""
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    table = cos_sin_cache.to(torch.float64)[positions]
    cos = table[:, None, :half]
    sin = table[:, None, half:]
    x = x.to(torch.float64)
    first, second, tail = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, tail], dim=-1)


def attention_reference(
    q: torch.Tensor,  # [T, Hq, D] unrotated
    kv: PagedKV,
    ext: ExtendRows,
    cos_sin_cache: torch.Tensor,  # [P, rotary_dim]
    sm_scale: float,
    keys_rotated: bool = False,
    span: SpanScaling | None = None,
) -> torch.Tensor:
    """[T, Hq, Dv] float64. Query t sees keys j of its request with attn_lo[t] <= j <= positions[t]. With `span`,
    a query outside its request's spans attends to its span groups, each with tempered logits, and the rest, each
    normalized on its own and weighted by APE's scaled log-sum-exps (SpanScaling)."""
    num_heads = q.shape[1]
    group = num_heads // kv.k_buffer.shape[1]
    out = torch.zeros((q.shape[0], num_heads, kv.v_buffer.shape[-1]), dtype=torch.float64, device=q.device)
    positions, attn_lo = ext.positions, ext.attn_lo
    for b in range(kv.req_pool_indices.shape[0]):
        seq_len = int(kv.seq_lens[b])
        start, count = int(ext.extend_start_loc[b]), int(ext.extend_seq_lens[b])
        key_idx = torch.arange(seq_len, device=q.device)
        slots = kv.req_to_token[kv.req_pool_indices[b], :seq_len]
        keys = kv.k_buffer[slots].to(torch.float64)
        if not keys_rotated:
            keys = rope_f64(keys, key_idx, cos_sin_cache)
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = kv.v_buffer[slots].to(torch.float64).repeat_interleave(group, dim=1)
        for c in range(start, start + count, QUERY_CHUNK):
            rows = torch.arange(c, min(c + QUERY_CHUNK, start + count), device=q.device)
            pos = positions[rows]
            q_rot = rope_f64(q[rows], pos, cos_sin_cache)  # [n, Hq, D]
            scores = torch.einsum("nhd,lhd->hnl", q_rot, keys) * sm_scale
            visible = (key_idx[None, :] >= attn_lo[rows][:, None]) & (key_idx[None, :] <= pos[:, None])
            scores = scores.masked_fill(~visible[None], float("-inf"))
            out[rows] = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)
            if span is not None:
                _span_groups(out, rows, pos, scores, values, key_idx, span, b)
    return out


def _span_groups(out, rows, pos, scores, values, key_idx, span: SpanScaling, b: int) -> None:
    """Overwrite the rows of queries outside request b's spans with APE's merge of their key groups (each span
    group, then the rest)."""
    first, last = int(span.range_start[b]), int(span.range_start[b + 1])
    lo_hi = span.ranges[first:last].tolist()
    in_span = torch.zeros_like(key_idx, dtype=torch.bool)
    lses, outs = [], []
    for g in range(span.num_groups):
        mine = [r for r in range(first, last) if int(span.group[r]) == g]
        if not mine:
            continue
        in_group = torch.zeros_like(key_idx, dtype=torch.bool)
        for r in mine:
            in_group |= (key_idx >= int(span.ranges[r, 0])) & (key_idx < int(span.ranges[r, 1]))
        in_span |= in_group
        temp, scale = float(span.temperature[mine[0]]), float(span.scale[mine[0]])
        tempered = scores.masked_fill(~in_group[None, None, :], float("-inf")) / temp
        lses.append(scale * temp * torch.logsumexp(tempered, -1))  # [H, n]
        outs.append(torch.einsum("hnl,lhd->nhd", torch.softmax(tempered, -1).nan_to_num(0.0), values))
    plain = scores.masked_fill(in_span[None, None, :], float("-inf"))
    lses.append(torch.logsumexp(plain, -1))
    outs.append(torch.einsum("hnl,lhd->nhd", torch.softmax(plain, -1).nan_to_num(0.0), values))
    w = torch.softmax(torch.stack(lses), dim=0).nan_to_num(0.0)  # [groups + 1, H, n]
    merged = sum(w[i].T[..., None] * o for i, o in enumerate(outs))
    scaled = torch.tensor([not any(lo <= p < hi for lo, hi in lo_hi) for p in pos.tolist()], device=out.device)
    out[rows[scaled]] = merged[scaled]


def store_reference(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> None:
    """Writes k (rotated by positions when given) and v into their slots, rounding once to the pool dtype."""
    if positions is not None:
        k = rope_f64(k, positions, cos_sin_cache)
    k_buffer[loc] = to_kv_dtype(k, k_buffer.dtype)
    v_buffer[loc] = to_kv_dtype(v, v_buffer.dtype)


def relative_errors(out: torch.Tensor, expect: torch.Tensor) -> tuple[float, float]:
    """(||out - expect|| / ||expect|| over everything, the worst of the same ratio per last-dim row)."""
    diff = (out.double() - expect.double()).flatten(0, -2)
    base = expect.double().flatten(0, -2)
    whole = (diff.norm() / base.norm()).item()
    worst_row = (diff.norm(dim=-1) / base.norm(dim=-1).clamp_min(1e-6)).max().item()
    return whole, worst_row
