"""ForwardBatch construction for the three forwards speculation runs: draft steps, verification, observation.

Each request contributes one contiguous run of new tokens that ends at its last visible key, so a run is given by
its first position and length. Which table and attention backend a batch uses is the caller's choice: draft
batches read batch-local draft tables, verification and observation the request's full KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_pic.forward_batch import BatchRows, ForwardBatch, ForwardMode
from sglang_pic.utils_tensor import upload


@dataclass
class Run:
    """A request's new tokens: positions first .. first+len(ids)-1, seeing keys attn_lo .. their own position."""

    table_row: int  # row of the batch's token table
    first: int  # position of the first new token
    ids: list[int] | torch.Tensor  # token ids (a device tensor avoids a sync for drafted tokens)
    attn_lo: list[int] = field(default_factory=list)  # per token; empty means 0
    seq_len: int | None = None  # keys 0..seq_len-1 addressable; defaults to first + len(ids)
    span_adapter: bool = False  # its request runs under the span adapter (forward_batch.py)

    def __len__(self) -> int:
        return len(self.ids)


def make_batch(
    runner,
    runs: list[Run],
    out_cache_loc: torch.Tensor,
    req_to_token_pool,
    attn_backend,
    logits: bool,
    mode: ForwardMode = ForwardMode.EXTEND,
) -> ForwardBatch:
    """`logits`: compute logits for every new token (otherwise none)."""
    rows = BatchRows()
    for run in runs:
        n = len(run)
        rows.add(run.table_row, range(run.first, run.first + n), run.attn_lo or [0] * n, run.seq_len,
                 run.span_adapter)
    if logits:
        rows.logits_indices = list(range(rows.num_tokens))
    ids = _device_ids(runs, runner.device)
    if ids is None:
        rows.input_ids = [i for run in runs for i in run.ids]
    return ForwardBatch.build(
        mode, rows, out_cache_loc, runner.device, req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool, attn_backend=attn_backend, input_ids=ids,
    )


def _device_ids(runs: list[Run], device: torch.device) -> torch.Tensor | None:
    """The runs' token ids in one device tensor when some are drafted tokens already there (their values need no
    sync); None when all are host lists, which then ride along in the batch's one upload."""
    if not any(isinstance(run.ids, torch.Tensor) for run in runs):
        return None
    return torch.cat([
        run.ids if isinstance(run.ids, torch.Tensor) else upload(list(run.ids), device=device) for run in runs
    ])
