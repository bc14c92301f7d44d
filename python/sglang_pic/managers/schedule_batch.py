"""Turn the scheduler's choice for one step (which requests, how many new tokens each) into a ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_pic.managers.req import Req
from sglang_pic.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class BatchEntry:
    """One request's share of a step: counts[i] new tokens for segment i, taken in logical order."""

    req: Req
    counts: list[int]
    positions: list[int] = field(default_factory=list)
    attn_lo: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    completes: bool = False  # after this step the request has no pending token: sample its next token
    logprob_positions: list[int] = field(default_factory=list)  # positions whose logits score the next input token
    slots: torch.Tensor | None = None  # KV slots of the new tokens, in the order of `positions`

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


def plan_entry(req: Req, budget: int) -> BatchEntry:
    """Take up to `budget` of the request's pending tokens, earliest positions first."""
    counts = []
    entry = BatchEntry(req=req, counts=counts)
    left = budget
    for seg in req.segments:
        n = min(len(seg.tokens) - seg.done, left)
        counts.append(n)
        if n > 0:
            first = seg.start + seg.done
            entry.positions.extend(range(first, first + n))
            entry.attn_lo.extend([seg.attn_lo] * n)
            entry.input_ids.extend(seg.tokens[seg.done : seg.done + n])
            left -= n
    entry.completes = req.pending() == entry.num_tokens
    if req.needs_input_logprobs():
        lo = max(req.logprob_start_len - 1, 0)
        entry.logprob_positions = [p for p in entry.positions if lo <= p <= req.prompt_len - 2]
    return entry


def build_forward_batch(entries: list[BatchEntry], out_cache_loc: torch.Tensor, runner) -> ForwardBatch:
    """Flatten entries into token rows; logits rows are the logprob positions plus each completing last token."""
    device = runner.device
    input_ids, positions, attn_lo = [], [], []
    seq_lens, ext_lens, starts, logit_rows = [], [], [], []
    for e in entries:
        starts.append(len(input_ids))
        for p in e.logprob_positions:
            logit_rows.append(len(input_ids) + e.positions.index(p))
        if e.completes and not e.req.warmup:  # the last position is never a logprob position (they end at prompt_len - 2)
            logit_rows.append(len(input_ids) + e.num_tokens - 1)
        input_ids.extend(e.input_ids)
        positions.extend(e.positions)
        attn_lo.extend(e.attn_lo)
        seq_lens.append(e.positions[-1] + 1)
        ext_lens.append(e.num_tokens)
    is_decode = all(
        e.num_tokens == 1 and e.attn_lo[0] == 0 and e.positions[0] == e.req.seq_len() - 1 for e in entries
    )

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    return ForwardBatch(
        forward_mode=ForwardMode.DECODE if is_decode else ForwardMode.EXTEND,
        batch_size=len(entries),
        input_ids=t(input_ids),
        positions=t(positions),
        attn_lo=t(attn_lo),
        out_cache_loc=out_cache_loc.to(device),
        req_pool_indices=t([e.req.req_pool_idx for e in entries]),
        seq_lens=t(seq_lens),
        extend_seq_lens=t(ext_lens),
        extend_start_loc=t(starts),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=ext_lens,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend,
        logits_indices=t(logit_rows),
    )
