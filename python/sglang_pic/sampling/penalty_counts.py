"""Token counts for the repetition / frequency / presence penalties, kept on the device from step to step.

Building them again every step from every prompt and output id cost host time that grew with each sequence (a
batch of 128 with 2K-token prompts under a repetition penalty: tens of ms per step to list and upload the ids).
Here each penalised request owns a row of a [rows, V] table: its prompt tokens are marked once, and each step adds
only the output tokens that arrived since the last one, all requests in one scatter. A step's batch then gathers
its rows. Output ids are append-only, so a row's count of them stays valid across retraction and resumption.
A sampled token is counted on the device at once (`add_sampled`), so the next step can sample before the host has
it. A finished request's row is cleared and reused at the next step that samples with penalties (no hook in the
finish and abort paths). The table grows to the most penalised requests running at once and stays there: 5 bytes
per row and vocabulary entry (0.76 MB per request with a 152K vocabulary), about what one step's freshly built
counts took before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.utils_tensor import upload

if TYPE_CHECKING:
    from sglang_pic.managers.req import Req

ZERO_ROW = 0  # never handed out: the row gathered for requests without penalties


def uses_history(req: Req) -> bool:
    """Whether the request's next-token distribution depends on the tokens it has seen."""
    sp = req.sampling_params
    return sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0 or sp.repetition_penalty != 1.0


@dataclass
class TokenHistory:
    """What the penalties of one batch look at, one row per batch row."""

    output_counts: torch.Tensor  # [B, V] float32 occurrences of each token in the output (and extra tokens)
    seen: torch.Tensor | None  # [B, V] bool token occurs in prompt or output; None unless asked for


@dataclass
class _Row:
    index: int
    counted: int = 0  # leading output ids added to the row (one more than the host has while a token is uncommitted)


class PenaltyCounts:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self.free: list[int] = []
        self.rows: dict[Req, _Row] = {}

    def history(self, reqs: list[Req], extras: list[list[int]] | None = None, want_seen: bool = False) -> TokenHistory:
        """Rows for `reqs` as if each had also output its `extras` (drafted tokens not yet committed); requests
        without penalties get zeros."""
        penalised = [uses_history(r) for r in reqs]
        index = upload([self._row(r).index if p else ZERO_ROW for r, p in zip(reqs, penalised)], device=self.device)
        self._catch_up()
        counts = self.output_counts[index]
        drafted = [(i, extra) for i, extra in enumerate(extras or []) if penalised[i] and extra]
        if drafted:
            rows = [i for i, extra in drafted for _ in extra]
            ids = [t for _, extra in drafted for t in extra]
            _scatter_add(counts, upload(rows, ids, device=self.device).view(2, -1))
        seen = self.prompt_seen[index] | (counts > 0) if want_seen else None
        return TokenHistory(counts, seen)

    def _row(self, req: Req) -> _Row:
        row = self.rows.get(req)
        if row is None:
            row = self.rows[req] = _Row(self._alloc(), 0)
            if req.sampling_params.repetition_penalty != 1.0:
                ids = req.prompt_ids()
                index = upload([row.index] * len(ids), ids, device=self.device).view(2, -1)
                self.prompt_seen[index[0], index[1]] = True
        return row

    def _catch_up(self) -> None:
        """Add every row's new output ids in one scatter; clear and free the rows of finished requests."""
        rows, ids, freed = [], [], []
        for req, row in list(self.rows.items()):
            if req.finished_reason is not None:
                del self.rows[req]
                freed.append(row.index)
                continue
            new = req.output_ids[row.counted :]
            rows += [row.index] * len(new)
            ids += new
            row.counted += len(new)
        if freed:
            index = upload(freed, device=self.device)
            self.output_counts[index] = 0.0
            self.prompt_seen[index] = False
            self.free += freed
        if ids:
            _scatter_add(self.output_counts, upload(rows, ids, device=self.device).view(2, -1))

    def add_sampled(self, reqs: list[Req], ids: torch.Tensor) -> None:
        """Count each penalised request's just-sampled token `ids[i]` on the device, before the host has it: the
        next step may sample before this one's tokens are committed (overlap scheduling). The catch-up then skips
        the token once it is appended."""
        rows = [(i, row) for i, row in enumerate(map(self.rows.get, reqs)) if row is not None]
        if not rows:
            return
        index = upload([i for i, _ in rows], [row.index for _, row in rows], device=self.device).view(2, -1)
        for _, row in rows:
            row.counted += 1
        _scatter_add(self.output_counts, torch.stack((index[1], ids[index[0]])))

    def _alloc(self) -> int:
        if not self.free:
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        """Double the rows (at least 8 new ones); capacity follows the most penalised requests seen at once."""
        old = self.output_counts.shape[0]
        new = old + max(8, old - 1)
        self.output_counts = _extend(self.output_counts, new)
        self.prompt_seen = _extend(self.prompt_seen, new)
        self.free.extend(range(new - 1, old - 1, -1))


def _scatter_add(counts: torch.Tensor, index: torch.Tensor) -> None:
    """counts[index[0][i], index[1][i]] += 1 for every i, repeats included."""
    ones = torch.ones(index.shape[1], dtype=counts.dtype, device=counts.device)
    counts.index_put_((index[0], index[1]), ones, accumulate=True)


def _extend(table: torch.Tensor, rows: int) -> torch.Tensor:
    grown = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=table.device)
    grown[: table.shape[0]] = table
    return grown
