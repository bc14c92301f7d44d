"""The paged-pool layouts attention kernels and their torch references read, as typed objects instead of long
argument lists. They name tensors only: what a request is, and which table or pool it uses, is the caller's business.

`PagedKV`: one layer's keys and values in the pool and the keys each request sees. `ExtendRows`: where each
request's new tokens (the queries of an extend) sit in the batch and what they see. Host-side bounds ride along
(`max_seq_len`, `max_extend_len`) so that kernels size their grids without reading the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKV:
    """Request b sees keys j < seq_lens[b]; key j is slot req_to_token[req_pool_indices[b], j] of the buffers,
    stored unrotated (a kernel's keys_rotated=True reads keys that were rotated by j at store time)."""

    k_buffer: torch.Tensor  # [slots, Hkv, D]
    v_buffer: torch.Tensor  # [slots, Hkv, Dv]
    req_to_token: torch.Tensor  # [rows, width] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    max_seq_len: int = 0  # host bound on seq_lens; 0: unknown (kernels that size grids by it need it)


@dataclass(frozen=True)
class ExtendRows:
    """Request b's new tokens are rows extend_start_loc[b] .. + extend_seq_lens[b] of the queries, in increasing
    position order; the query at row t sits at positions[t] and sees keys attn_lo[t] .. positions[t]."""

    extend_start_loc: torch.Tensor  # [B] int64
    extend_seq_lens: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [T] int64
    attn_lo: torch.Tensor  # [T] int64
    max_extend_len: int  # host bound on extend_seq_lens (it sizes the extend grid and may exceed the true maximum)


@dataclass(frozen=True)
class SpanScaling:
    """APE's query-time scaling of attention to span keys, per request b of a batch. Its span keys are the key index
    ranges [lo, hi) in ranges[range_start[b] : range_start[b + 1]]: spans whose KV was encoded apart from the request
    (a span job's, or its own isolated prefill). Its ranges form groups (group[r], 0 .. num_groups - 1 within the
    request; a group's ranges share their factors). A query outside those ranges sees each group's keys with logits
    divided by the group's temperature, weighted against the other keys by exp(scale * temperature * LSE), LSE the
    group's log-sum-exp of its tempered logits; queries inside a span (the span encoding itself) are not scaled.
    temperature = scale = 1 is plain attention: such spans are left out of the ranges."""

    ranges: torch.Tensor  # [R, 2] int64
    range_start: torch.Tensor  # [B + 1] int64
    group: torch.Tensor  # [R] int64: the range's group among its request's
    temperature: torch.Tensor  # [R] float32: its group's
    scale: torch.Tensor  # [R] float32: its group's
    num_groups: int  # host bound on any request's groups

    def in_spans(self, index: torch.Tensor, requests: torch.Tensor | None = None,
                 group: int | None = None) -> torch.Tensor:
        """Whether key index index[i, ...] of request requests[i] (default: request i) lies in one of its spans (of
        its group `group`; None: any)."""
        b = torch.arange(self.range_start.shape[0] - 1, device=index.device) if requests is None else requests
        mine = self._ranges_of(b, group)
        idx = index.reshape(index.shape[0], -1, 1)
        inside = (idx >= self.ranges[:, 0]) & (idx < self.ranges[:, 1]) & mine[:, None, :]
        return inside.any(-1).view(index.shape)

    def group_factors(self, group: int, requests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperature, scale) [n] of group `group` of request requests[i]; 1 where it has no such group."""
        mine = self._ranges_of(requests, group)
        has = mine.any(1)
        first = mine.int().argmax(1)
        one = torch.ones((), device=requests.device)
        return (torch.where(has, self.temperature[first], one).float(),
                torch.where(has, self.scale[first], one).float())

    def _ranges_of(self, requests: torch.Tensor, group: int | None) -> torch.Tensor:
        """[n, R] bool: range r belongs to request requests[i] (and to its group `group`; None: any)."""
        owner = torch.repeat_interleave(self.range_start.diff())  # [R] request of each range
        mine = owner[None, :] == requests[:, None]
        return mine if group is None else mine & (self.group == group)[None, :]
