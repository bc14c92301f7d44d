"""Drafting and acceptance for speculative decoding, matched to the engine's Sampler so output is unchanged.

Greedy rows: a draft token is accepted iff it is the target's argmax; the first mismatch is replaced by the
target's argmax, so the output equals full-KV greedy decoding. Sampled rows use speculative (rejection) sampling:
draft token d ~ q is accepted with probability min(1, p(d) / q(d)); on rejection the token is drawn from
norm(max(p - q, 0)); after k acceptances a bonus token is drawn from p. Each committed token is then distributed
exactly as p, the distribution the Sampler would draw from at that step (penalties, bans, temperature, top-k/p,
min-p), so the output distribution equals full-KV sampling. Randomness comes from the request's own generator
when it has a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.sampling.penalty_counts import PenaltyCounts
from sglang_pic.sampling.sampler import adjust_logits, filter_probs
from sglang_pic.sampling.sampling_batch_info import SamplingBatchInfo

if TYPE_CHECKING:
    from sglang_pic.managers.req import Req  # annotations only: requests belong to the scheduler, a layer above


def sampling_info(
    rows: list[tuple[Req, list[int]]], vocab_size: int, device: torch.device, penalties: PenaltyCounts
) -> SamplingBatchInfo:
    """Sampling parameters for rows that each continue a request's output by some drafted tokens.

    Row (req, extra) is set up as the Sampler would see req after `extra` had been output: penalties count them
    and the min_new_tokens ban follows the longer output. Tokens in `extra` only matter under uses_history().
    """
    reqs = [req for req, _ in rows]
    return SamplingBatchInfo.from_requests(reqs, vocab_size, device, penalties, [extra for _, extra in rows])


@dataclass
class Distributions:
    """What the Sampler would do with some logits rows: greedy choices and, for sampled rows, normalized probs."""

    argmax: torch.Tensor  # [N] argmax of the adjusted logits (the greedy choice)
    probs: torch.Tensor | None  # [N, V] the distribution a sampled row draws from; None when all rows are greedy
    greedy: list[bool]


def distributions(logits: torch.Tensor, info: SamplingBatchInfo) -> Distributions:
    adjusted = adjust_logits(logits.float(), info)
    argmax = adjusted.argmax(dim=-1)
    greedy = info.greedy_rows
    if info.is_all_greedy:
        return Distributions(argmax, None, greedy)
    probs = filter_probs(torch.softmax(adjusted / info.temperatures, dim=-1), info)
    return Distributions(argmax, probs / probs.sum(dim=-1, keepdim=True), greedy)


def _near(generator: torch.Generator | None, x: torch.Tensor) -> torch.Tensor:
    """x on the generator's device (a seeded request's generator may live on the CPU)."""
    return x if generator is None or generator.device == x.device else x.to(generator.device)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(_near(generator, probs), 1, generator=generator))


def draft_tokens(dist: Distributions, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One drafted token per row: the argmax on greedy rows, a draw from q elsewhere."""
    if dist.probs is None:
        return dist.argmax
    tokens = dist.argmax.clone()
    for row, (greedy, gen) in enumerate(zip(dist.greedy, generators)):
        if not greedy:
            tokens[row] = draw(dist.probs[row], gen)
    return tokens


def accept_greedy(drafts: list[int], target: list[int]) -> tuple[int, int]:
    """(accepted drafts a, the target's token after them); target[i] is the argmax after i drafts."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a, target[a]


def accept_sampled(
    drafts: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling: q [k, V] drafted the tokens, p [k + 1, V] is the target after 0..k drafts."""
    k = len(drafts)
    if k:
        ids = torch.tensor(drafts, device=p.device)
        rows = torch.arange(k, device=p.device)
        u = torch.rand(k, generator=generator, device=p.device if generator is None else generator.device)
        ok = (u.to(p.device) * q[rows, ids] < p[rows, ids]).tolist()
        a = ok.index(False) if False in ok else k
    else:
        a = 0
    if a == k:
        return a, draw(p[k], generator)
    residual = (p[a] - q[a]).clamp_(min=0)
    total = float(residual.sum())
    return a, draw(residual / total if total > 0 else p[a], generator)
