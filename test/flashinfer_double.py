"""A torch double of the FlashInfer kernels the FlashInfer backend calls, written from FlashInfer's documented
semantics (not from the engine's kernels): with pages of one slot, row r's keys are the slots
kv_indices[kv_indptr[r]:kv_indptr[r+1]], the key at index j is rotated by j, the row's query i (of qo_len) by
kv_len - qo_len + i, rotation in the rotate-half (Llama) form with frequencies theta^(-2d/D) over positions divided
by rope_scale, and causal attention in those positions, or a custom mask (row by row, each row's [qo_len, kv_len]
flattened query-major) with the log-sum-exp of the logits in base 2 beside the output. It runs on CPU in float32, so the backend's planning is
checked against the torch_native backend without a GPU."""

from __future__ import annotations

import math

import torch

from sglang_pic.layers.flashinfer_backend import HeadShape, RopeParams
from sglang_pic.layers.flashinfer_rows import RaggedRows, SpanGroups


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RopeParams) -> torch.Tensor:
    half = x.shape[-1] // 2
    inv = 1.0 / rope.theta ** (torch.arange(half, dtype=torch.float64) / half)
    angle = (positions.double()[:, None] / rope.scale) * inv[None]
    cos, sin = angle.cos()[:, None].float(), angle.sin()[:, None].float()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class FlashInferDouble:
    plans: list[tuple[RaggedRows, int | None]] = []  # every plan (rows, graph size) of every instance

    def __init__(self, shape: HeadShape, rope: RopeParams, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.rope = shape, rope
        self.rows: RaggedRows | None = None

    def reserve_graphs(self, max_bs: int, max_request_keys: int) -> None:
        self.graph_keys = max_bs * max_request_keys

    def plan(self, rows: RaggedRows, graph_size: int | None = None) -> None:
        assert rows.qo_indptr.device.type == "cpu" and rows.kv_indptr.device.type == "cpu"
        assert rows.kv_indices.dtype == torch.int32 and bool((rows.kv_last_page_len == 1).all())
        if graph_size is not None:  # a graph's plan: one query per request, its keys within the reserved buffer
            assert rows.one_query_per_row and rows.num_rows == graph_size and rows.kv_indices.numel() <= self.graph_keys
        self.rows = rows
        FlashInferDouble.plans.append((rows, graph_size))

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> torch.Tensor:
        return self._attend(self.rows, q, k_buffer, v_buffer, None)[0]

    def plan_split(self, rows: RaggedRows, groups: SpanGroups) -> None:
        self.plan(rows)
        self.masks = [groups.rest_mask, *groups.span_masks]

    def run_split(self, queries, k_buffer, v_buffer):
        return [self._attend(self.rows, q, k_buffer, v_buffer, m) for q, m in zip(queries, self.masks)]

    def _attend(self, rows: RaggedRows, q, k_buffer, v_buffer, mask: torch.Tensor | None):
        shape = self.shape
        assert q.shape[0] == rows.num_queries
        group = shape.num_qo_heads // shape.num_kv_heads
        out = q.new_zeros((q.shape[0], shape.num_qo_heads, shape.v_head_dim))
        lse = torch.zeros((q.shape[0], shape.num_qo_heads), dtype=torch.float32)
        offset = 0
        for r in range(rows.num_rows):
            q0, q1 = int(rows.qo_indptr[r]), int(rows.qo_indptr[r + 1])
            k0, k1 = int(rows.kv_indptr[r]), int(rows.kv_indptr[r + 1])
            slots = rows.kv_indices[k0:k1].long()
            kv_len, qo_len = k1 - k0, q1 - q0
            key_pos = torch.arange(kv_len)
            query_pos = kv_len - qo_len + torch.arange(qo_len)
            keys = rotate(k_buffer[slots], key_pos, self.rope).repeat_interleave(group, dim=1)
            values = v_buffer[slots].float().repeat_interleave(group, dim=1)
            queries = rotate(q[q0:q1], query_pos, self.rope)
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * shape.sm_scale
            if mask is None:
                seen = key_pos[None, :] <= query_pos[:, None]
            else:
                seen = mask[offset : offset + qo_len * kv_len].view(qo_len, kv_len).cpu()
                offset += qo_len * kv_len
            scores = scores.masked_fill(~seen[None], float("-inf"))
            row_lse = torch.logsumexp(scores, -1)  # [H, q]; -inf where a query sees no key
            probs = torch.where(seen[None], (scores - row_lse[..., None]).exp(), 0.0)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
            lse[q0:q1] = (row_lse / math.log(2)).T
        return out, lse
