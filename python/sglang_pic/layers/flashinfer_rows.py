"""A batch of position-free requests as FlashInfer's rows: queries over page lists whose index is the key position.

FlashInfer's in-kernel RoPE (`pos_encoding_mode="ROPE_LLAMA"`) rotates the key at index j of a row's page list by
j and the query i of a row with `qo_len` queries over `kv_len` keys by kv_len - qo_len + i, attending causally in
those positions. With pages of one slot, a row's page list is any run of a request's slots in logical order, so
the engine's layout maps onto it as:
- a run of new tokens at consecutive positions p0..p1 that all see keys from `lo` (the request's start for prefix,
  PDEP, recomputed head and decode tokens; the span's start for an uncached span) is one row over the slots
  req_to_token[req, lo .. p1]; its queries sit at p0 - lo + i, its keys at j - lo.
- RoPE scores depend on position differences only, so a span row shifted by `lo` attends exactly as it does at its
  logical offset.
A request's new tokens can form several rows (cached spans sit between them, an uncached span switches `lo`);
rows keep the batch's token order, so the queries need no permutation. Rows of one request read each other's keys,
which the backend stores before it attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_pic.kernels.paged_layout import SpanScaling


@dataclass(frozen=True)
class RaggedRows:
    """FlashInfer's description of one forward's attention, with pages of one slot (last page length 1)."""

    qo_indptr: torch.Tensor  # [R+1] int32, on the host: row r's queries are qo_indptr[r] .. qo_indptr[r+1]
    kv_indptr: torch.Tensor  # [R+1] int32, on the host: row r's keys are kv_indices[kv_indptr[r] .. kv_indptr[r+1]]
    kv_indices: torch.Tensor  # [nnz] int32, on the KV device: the slots, in each row's key order
    kv_last_page_len: torch.Tensor  # [R] int32, on the KV device: all ones
    one_query_per_row: bool  # a decode batch: FlashInfer's decode kernels apply
    row_req: list[int]  # each row's request (its index in the batch)
    row_lo: list[int]  # each row's first key index: key k of row r is the request's key lo + k

    @property
    def num_rows(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_queries(self) -> int:
        return int(self.qo_indptr[-1])


def split_runs(
    positions: list[int], attn_lo: list[int], extend_seq_lens: list[int]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The batch's new tokens cut into rows: for each row its request, its first key index `lo`, its number of
    queries and its last query's position. A row ends at a request boundary, a gap in positions or a change of lo."""
    row_req, row_lo, row_q, row_last = [], [], [], []
    t = 0
    for b, n in enumerate(extend_seq_lens):
        for i in range(t, t + n):
            if i > t and positions[i] == positions[i - 1] + 1 and attn_lo[i] == attn_lo[i - 1]:
                row_q[-1] += 1
                row_last[-1] = positions[i]
                continue
            row_req.append(b)
            row_lo.append(attn_lo[i])
            row_q.append(1)
            row_last.append(positions[i])
        t += n
    return row_req, row_lo, row_q, row_last


def ragged_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    row_req: list[int],
    row_lo: list[int],
    row_q: list[int],
    row_kv: list[int],
    one_query_per_row: bool = False,
) -> RaggedRows:
    """Rows given per row as (request index in the batch, first key index, queries, keys); `req_pool_indices`
    are the batch's requests' rows of `req_to_token`, from which the key slots are gathered on its device in one
    indexing pass."""
    device = req_to_token.device
    qo = torch.zeros(len(row_q) + 1, dtype=torch.int32)
    kv = torch.zeros(len(row_kv) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(row_q, dtype=torch.int32), 0, out=qo[1:])
    torch.cumsum(torch.tensor(row_kv, dtype=torch.int32), 0, out=kv[1:])
    lens = torch.tensor(row_kv, dtype=torch.int64, device=device)
    nnz = int(kv[-1])
    starts = kv[:-1].to(device=device, dtype=torch.int64)
    lo = torch.tensor(row_lo, dtype=torch.int64, device=device)
    reqs = torch.tensor([req_pool_indices[b] for b in row_req], dtype=torch.int64, device=device)
    shift = torch.repeat_interleave(lo - starts, lens, output_size=nnz)  # key k of row r reads index lo_r + k
    cols = torch.arange(nnz, dtype=torch.int64, device=device) + shift
    rows = torch.repeat_interleave(reqs, lens, output_size=nnz)
    indices = req_to_token[rows, cols].to(torch.int32)
    last_page = torch.ones(len(row_kv), dtype=torch.int32, device=device)
    return RaggedRows(qo, kv, indices, last_page, one_query_per_row, list(row_req), list(row_lo))


def extend_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    positions: list[int],
    attn_lo: list[int],
    extend_seq_lens: list[int],
) -> RaggedRows:
    """An extend batch's rows (prefill chunks, spans, PDEP and head tokens, riding decodes)."""
    row_req, row_lo, row_q, row_last = split_runs(positions, attn_lo, extend_seq_lens)
    row_kv = [last - lo + 1 for lo, last in zip(row_lo, row_last)]
    return ragged_rows(req_to_token, req_pool_indices, row_req, row_lo, row_q, row_kv)


def decode_rows(req_to_token: torch.Tensor, req_pool_indices: list[int], seq_lens: list[int]) -> RaggedRows:
    """A decode batch: one row per request over all its keys, its query at seq_len - 1."""
    n = len(seq_lens)
    return ragged_rows(req_to_token, req_pool_indices, list(range(n)), [0] * n, [1] * n, seq_lens, True)


@dataclass(frozen=True)
class SpanGroups:
    """APE's split of a forward's attention (SpanScaling) into FlashInfer passes over the same rows, one per span
    group and one for the rest, as custom masks in FlashInfer's layout (row by row, each row's [qo_len, kv_len]
    flattened query-major): `span_masks[g]` holds the keys a query outside the spans sees as its span group g,
    `rest_mask` every other key it sees; queries inside a span see all their keys in `rest_mask`."""

    span_masks: torch.Tensor  # [groups, sum qo_len * kv_len] bool
    rest_mask: torch.Tensor  # [sum qo_len * kv_len] bool
    temperature: torch.Tensor  # [groups, queries] float32: a group pass's logits are divided by it
    weight: torch.Tensor  # [groups, queries] float32: scale * temperature, the factor on the group's log-sum-exp
    has_span: torch.Tensor  # [groups, queries] bool: the query's span group is not empty


def span_groups(rows: RaggedRows, span: SpanScaling) -> SpanGroups:
    """The passes' masks for `rows`, on the KV device: a key is in a query's span group g when it lies in one of its
    request's span ranges of group g, the query lies in none, and causality lets the query see it. Beside the
    masks only per-key and per-query tensors are made: a one-query row's mask is its keys' flags, a longer row's an
    outer product (index tensors the size of the masks would take gigabytes for an 8K-token chunk over 16K keys)."""
    device = rows.kv_indices.device
    i64 = dict(dtype=torch.int64, device=device)
    q_len, kv_len = rows.qo_indptr.diff().tolist(), rows.kv_indptr.diff().tolist()
    q_start, kv_start = rows.qo_indptr[:-1].tolist(), rows.kv_indptr[:-1].tolist()
    q_len_t, kv_len_t, q_start_t, key_start = (torch.tensor(x, **i64) for x in (q_len, kv_len, q_start, kv_start))
    n_rows, nq, nnz, n_groups = rows.num_rows, rows.num_queries, int(rows.kv_indptr[-1]), span.num_groups
    req, lo = torch.tensor(rows.row_req, **i64), torch.tensor(rows.row_lo, **i64)
    row_ids = torch.arange(n_rows, **i64)

    key_row = torch.repeat_interleave(row_ids, kv_len_t, output_size=nnz)
    key_index = lo[key_row] + torch.arange(nnz, **i64) - key_start[key_row]
    key_in_group = torch.stack([span.in_spans(key_index, req[key_row], g) for g in range(n_groups)])  # [G, nnz]
    q_row = torch.repeat_interleave(row_ids, q_len_t, output_size=nq)
    q_offset = torch.arange(nq, **i64) - q_start_t[q_row]
    q_index = lo[q_row] + kv_len_t[q_row] - q_len_t[q_row] + q_offset
    q_scaled = ~span.in_spans(q_index, req[q_row])  # query i of a row sees its keys 0 .. kv_len - q_len + i

    sizes = [q * kv for q, kv in zip(q_len, kv_len)]
    elem_start = [0]
    for size in sizes[:-1]:
        elem_start.append(elem_start[-1] + size)
    masks = torch.zeros((n_groups, sum(sizes)), dtype=torch.bool, device=device)
    visible = torch.ones(sum(sizes), dtype=torch.bool, device=device)
    has_span = torch.zeros((n_groups, nq), dtype=torch.bool, device=device)
    single = torch.tensor([q == 1 for q in q_len], dtype=torch.bool, device=device)
    keys = single[key_row]  # the keys of one-query rows: their elements follow the keys' order
    if bool(keys.any()):
        at = (torch.tensor(elem_start, **i64) - key_start)[key_row[keys]] + torch.arange(nnz, **i64)[keys]
        query = q_start_t[key_row[keys]]
        flags = key_in_group[:, keys] & q_scaled[query][None, :]
        masks[:, at] = flags
        for g in range(n_groups):
            has_span[g, query[flags[g]]] = True
    for r in (r for r, q in enumerate(q_len) if q > 1):
        q0, k0, n_q, n_kv = q_start[r], kv_start[r], q_len[r], kv_len[r]
        seen = torch.arange(n_kv, device=device)[None, :] <= n_kv - n_q + torch.arange(n_q, device=device)[:, None]
        flags = seen & key_in_group[:, None, k0 : k0 + n_kv] & q_scaled[q0 : q0 + n_q][None, :, None]  # [G, q, kv]
        masks[:, elem_start[r] : elem_start[r] + sizes[r]] = flags.flatten(1)
        visible[elem_start[r] : elem_start[r] + sizes[r]] = seen.flatten()
        has_span[:, q0 : q0 + n_q] = flags.any(2)
    temperature, scale = (torch.stack(f) for f in zip(*(span.group_factors(g, req[q_row]) for g in range(n_groups))))
    return SpanGroups(masks, visible & ~masks.any(0), temperature, scale * temperature, has_span)
