"""ForwardBatch construction for the three forwards speculation runs: draft steps, verification, observation.

Each request contributes one contiguous run of new tokens that ends at its last visible key, so a run is given by
its first position and length. Which table and attention backend a batch uses is the caller's choice: draft
batches read batch-local draft tables, verification and observation the request's full KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_pic.forward_batch import ForwardBatch, ForwardMode
from sglang_pic.utils_tensor import upload


@dataclass
class Run:
    """A request's new tokens: positions first .. first+len(ids)-1, seeing keys attn_lo .. their own position."""

    table_row: int  # row of the batch's token table
    first: int  # position of the first new token
    ids: list[int] | torch.Tensor  # token ids (a device tensor avoids a sync for drafted tokens)
    attn_lo: list[int] = field(default_factory=list)  # per token; empty means 0
    seq_len: int | None = None  # keys 0..seq_len-1 addressable; defaults to first + len(ids)

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
    device = runner.device
    positions, attn_lo, seq_lens, ext_lens, starts = [], [], [], [], []
    for run in runs:
        n = len(run)
        starts.append(sum(ext_lens))
        ext_lens.append(n)
        positions.extend(range(run.first, run.first + n))
        attn_lo.extend(run.attn_lo or [0] * n)
        seq_lens.append(run.first + n if run.seq_len is None else run.seq_len)
    total, size = sum(ext_lens), len(runs)
    rows = [r.table_row for r in runs]
    # One copy for all the integers (a copy per list from pageable memory would wait for every queued kernel).
    packed = upload(positions, attn_lo, rows, seq_lens, ext_lens, starts, device=device)
    cuts = [total, total, size, size, size, size]
    positions_t, attn_lo_t, rows_t, seq_lens_t, ext_lens_t, starts_t = packed.split(cuts)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=size,
        input_ids=_input_ids(runs, device),
        positions=positions_t,
        attn_lo=attn_lo_t,
        out_cache_loc=out_cache_loc.to(device),
        req_pool_indices=rows_t,
        seq_lens=seq_lens_t,
        extend_seq_lens=ext_lens_t,
        extend_start_loc=starts_t,
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=ext_lens,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=attn_backend,
        logits_indices=torch.arange(total if logits else 0, device=device),
        attn_metadata={"draft_rows": rows},
    )


def _input_ids(runs: list[Run], device: torch.device) -> torch.Tensor:
    """The runs' token ids in one tensor: host lists in one upload, device tensors (drafted tokens) as they are."""
    if not any(isinstance(run.ids, torch.Tensor) for run in runs):
        return upload(*(list(run.ids) for run in runs), device=device)
    return torch.cat([
        run.ids if isinstance(run.ids, torch.Tensor) else upload(list(run.ids), device=device) for run in runs
    ])
