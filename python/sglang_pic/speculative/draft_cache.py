"""A request's draft cache, and the batch-local tables draft forwards read it through.

A draft cache is a list of device KV slots per layer (`rows`, shared by all layers when Lr == 1): the kept tokens
of a token-dropping compressor, or the full-precision recent tokens of KIVI (whose older tokens live in its own
quantized `prefix`). Tokens verified after the last compression are appended, so the draft always represents the
whole context [0, covered).

Positions: draft index j is rotated as position `pos_offset + j`. A token-dropping draft re-indexes its kept
tokens 0..length-1 (pos_offset 0): the attention kernels rotate key j of a row by j, so keeping each kept key's
original position would need a per-key position table in the kernels. Relative distances inside the recent
window stay exact and far tokens move closer, which only costs acceptance. KIVI keeps every token, so its
positions are the original ones.

While drafting, the drafted tokens' own KV goes to scratch slots appended after each request's rows; they are the
slots verification then overwrites with the real full-KV entries (see vericache_worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglang_pic.layers.attention_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention


@dataclass
class DraftCache:
    rows: torch.Tensor  # [Lr, capacity] int64 device slots, by draft index
    length: int  # valid entries of each row
    covered: int  # logical tokens [0, covered) are represented
    built_at: int  # `covered` at the last compression
    pos_offset: int = 0  # RoPE position of draft index 0
    prefix: Any = None  # a compressor's own storage for positions [0, pos_offset) (KIVI)
    state: Any = None  # the compressor's per-request state
    owned_pages: set[int] = field(default_factory=set)  # device pages the worker allocated for it (host tier mode)
    last_slot: int = -1  # host tier mode: newest slot appended, so the next allocation fills its page first

    @classmethod
    def from_rows(cls, rows: torch.Tensor, covered: int, state: Any = None, pos_offset: int = 0,
                  prefix: Any = None) -> "DraftCache":
        rows = rows if rows.dim() == 2 else rows[None]
        return cls(rows.clone(), rows.shape[1], covered, covered, pos_offset, prefix, state)

    @property
    def appended(self) -> int:
        return self.covered - self.built_at

    @property
    def num_layer_rows(self) -> int:
        return self.rows.shape[0]

    def active_rows(self) -> torch.Tensor:
        return self.rows[:, : self.length]

    def append(self, slots: torch.Tensor) -> None:
        """Add freshly verified tokens (same slot in every layer row) and count them as covered."""
        m = slots.numel()
        if self.length + m > self.rows.shape[1]:
            grown = torch.zeros(
                (self.rows.shape[0], max(2 * self.rows.shape[1], self.length + m)),
                dtype=self.rows.dtype,
                device=self.rows.device,
            )
            grown[:, : self.length] = self.rows[:, : self.length]
            self.rows = grown
        self.rows[:, self.length : self.length + m] = slots.to(self.rows.device)
        self.length += m
        self.covered += m

    def drop_front(self, m: int) -> None:
        """Forget the first m rows (KIVI moved them into its quantized prefix)."""
        self.rows = self.rows[:, m:].clone()
        self.length -= m
        self.pos_offset += m

    def referenced_pages(self, page_size: int) -> set[int]:
        return set(torch.unique(self.active_rows().cpu() // page_size).tolist())


@dataclass
class TokenTable:
    """Stands in for ReqToTokenPool in a ForwardBatch: backends read only `req_to_token`."""

    req_to_token: torch.Tensor


@dataclass
class DraftBatch:
    """One round's drafts side by side: tables[l, b] = request b's rows for layer l, then its scratch slots."""

    drafts: list[DraftCache]
    tables: torch.Tensor  # [Lr, B, W] int64
    lengths: list[int]
    pos_offsets: list[int]

    @classmethod
    def build(cls, drafts: list[DraftCache], scratch: list[torch.Tensor], device: torch.device) -> "DraftBatch":
        layers = max(d.num_layer_rows for d in drafts)
        width = max(max(d.length + s.numel() for d, s in zip(drafts, scratch)), 1)
        tables = torch.zeros((layers, len(drafts), width), dtype=torch.int64, device=device)
        for b, (d, s) in enumerate(zip(drafts, scratch)):
            tables[:, b, : d.length] = d.active_rows()
            tables[:, b, d.length : d.length + s.numel()] = s.to(device)
        return cls(drafts, tables, [d.length for d in drafts], [d.pos_offset for d in drafts])


class DraftBackend(AttentionBackend):
    """An attention backend for draft steps. One over static tables gets each round's DraftBatch through `load`
    (after the tables themselves), so it can copy per-request data into buffers a CUDA graph reads."""

    def load(self, batch: DraftBatch) -> None:
        """Nothing beyond the tables by default."""


class LayerTableBackend(DraftBackend):
    """Runs the engine's backend on draft tables, switching to layer l's table when selections differ per layer."""

    def __init__(self, inner: AttentionBackend, tables: torch.Tensor) -> None:
        self.inner = inner
        self.tables = [TokenTable(t) for t in tables]

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        forward_batch.req_to_token_pool = self.tables[layer.layer_id if len(self.tables) > 1 else 0]
        return self.inner.forward(q, k, v, layer, forward_batch)
