"""A step's sampling, next to the forward that made its logits: next token ids and the logprobs clients asked for,
computed on the device and on their way to the host, without the host waiting for the step.

The scheduler describes what the logits rows are for (StepSampling): some score prompt tokens (prompt logprobs),
the others are sampled, one per request. The sampled rows are described only once the forward is queued
(`describe`): the scheduler does its host work for the step then, and first commits the step before this one when
grammar masks need that step's tokens, which decides which rows are void (managers/overlap.py). Each sampled id is
also written to its request row's entry of `next_input_ids`, what the row's next decode step feeds, so that step
can be launched before the host has the id.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang_pic.sampling.grammar import GrammarBackend
from sglang_pic.sampling.logprobs import SampledLogprobs, compute_logprobs
from sglang_pic.sampling.penalty_counts import PenaltyCounts, uses_history
from sglang_pic.sampling.sampler import Sampler
from sglang_pic.sampling.sampling_batch_info import SamplingBatchInfo
from sglang_pic.utils_tensor import HostCopy, copy_to_host, upload

if TYPE_CHECKING:
    from sglang_pic.managers.req import Req  # annotations only: requests belong to the scheduler, a layer above


@dataclass
class PromptLogprobAsk:
    """Logits rows [start, start + len(targets)) each score the prompt token in `targets` that follows them."""

    start: int
    targets: list[int]
    top_num: int
    token_ids: list[int] | None


@dataclass
class SampleRows:
    """What sampling needs of each sampled row. The rest comes from the row's request: its sampling params, output
    so far and generator (penalties, min_new_tokens bans, seeds), the logprobs it asks for (return_logprob,
    top_logprobs_num, token_ids_logprob) and its request row (req_pool_idx; None: it left since the launch)."""

    reqs: list[Req]
    void: frozenset[int] = frozenset()  # rows whose token is dropped: they draw nothing from a seeded generator
    pending: Collection[int] = ()  # id() of requests with a sampled token not in their output yet (overlap)
    matchers: list[Any | None] | None = None  # per row, the grammar matcher that masks it (None: no mask)
    grammars: GrammarBackend | None = None


@dataclass
class StepSampling:
    prompt_logprobs: list[PromptLogprobAsk]
    sample_rows: list[int] | None  # the logits rows that are sampled, in order; None: every row
    describe: Callable[[], SampleRows]  # called once the forward is queued, before anything is sampled


@dataclass
class SampledOutput:
    ids: torch.Tensor  # [sampled rows] int64, on the device
    copies: list[HostCopy]  # `ids`, then the tensors of `logprobs`, on their way to the host
    logprob_rows: list[int]  # sampled rows whose requests return logprobs
    logprobs: SampledLogprobs | None
    void: frozenset[int]  # as described: rows whose token is dropped
    prompt_logprobs: list[tuple[SampledLogprobs, list[HostCopy]]]  # per ask, in order


class StepSampler:
    """Owns what sampling keeps between steps: the penalty counts and each request row's last sampled token."""

    def __init__(self, vocab_size: int, device: torch.device, num_req_rows: int) -> None:
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.penalties = PenaltyCounts(vocab_size, device)
        self.next_input_ids = torch.zeros(num_req_rows, dtype=torch.int64, device=device)

    def sample(self, logits: torch.Tensor, step: StepSampling) -> SampledOutput:
        prompt = [self._prompt_logprobs(logits, ask) for ask in step.prompt_logprobs]
        if step.sample_rows is not None:
            logits = logits[upload(step.sample_rows, device=logits.device)]
        logits = logits[:, : self.vocab_size].float()
        rows = step.describe()
        if rows.reqs:
            ids = self._sample_ids(logits, rows)
        else:
            ids = logits.new_empty(0, dtype=torch.int64)
        logprob_rows, logprobs = _sampled_logprobs(rows.reqs, logits, ids)
        copies = copy_to_host(ids, *(logprobs.tensors if logprobs is not None else []))
        return SampledOutput(ids, copies, logprob_rows, logprobs, rows.void, prompt)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, ask: PromptLogprobAsk) -> tuple[SampledLogprobs, list[HostCopy]]:
        n = len(ask.targets)
        lp = compute_logprobs(logits[ask.start : ask.start + n])
        targets = upload(ask.targets, device=lp.device)
        sampled = SampledLogprobs.compute(lp, targets, [ask.top_num] * n, [ask.token_ids] * n)
        return sampled, copy_to_host(*sampled.tensors)

    def _sample_ids(self, logits: torch.Tensor, rows: SampleRows) -> torch.Tensor:
        """Each row's next token, on the logits' device, also recorded as its request row's next decode input (and
        in the penalty counts), so the next step can run before the host has it."""
        reqs = rows.reqs
        if rows.matchers is not None and rows.grammars is not None:
            rows.grammars.mask_logits(logits, rows.matchers)
        if all(r.sampling_params.is_plain_greedy for r in reqs):  # the common case needs no per-request tensors
            ids = torch.argmax(logits, dim=-1)
        else:
            uncommitted = [int(id(r) in rows.pending) for r in reqs] if rows.pending else None
            info = SamplingBatchInfo.from_requests(
                reqs, self.vocab_size, logits.device, self.penalties, uncommitted=uncommitted
            )
            if rows.void:  # a void row leaves its request's generator alone: seeded outputs stay those of any schedule
                info.seeded_rows = [i for i in info.seeded_rows if i not in rows.void]
            ids = self.sampler(logits, info)
            if any(map(uses_history, reqs)):
                self.penalties.add_sampled(reqs, ids)
        slots = [r.req_pool_idx for r in reqs]
        if None in slots:  # requests that left since the launch (finished at a commit): their rows are dropped
            live = [i for i, slot in enumerate(slots) if slot is not None]
            index = upload(live, [slots[i] for i in live], device=ids.device).view(2, -1)
            self.next_input_ids[index[1]] = ids[index[0]]
        else:
            self.next_input_ids[upload(slots, device=ids.device)] = ids
        return ids


def _sampled_logprobs(
    reqs: list[Req], logits: torch.Tensor, ids: torch.Tensor
) -> tuple[list[int], SampledLogprobs | None]:
    """The rows whose requests return logprobs, and those rows' logprobs of their sampled tokens (on the device)."""
    rows = [i for i, r in enumerate(reqs) if r.return_logprob]
    if not rows:
        return rows, None
    if len(rows) < len(reqs):
        index = upload(rows, device=logits.device)
        logits, ids = logits[index], ids[index]
    return rows, SampledLogprobs.compute(
        compute_logprobs(logits), ids, [reqs[i].top_logprobs_num for i in rows],
        [reqs[i].token_ids_logprob for i in rows],
    )
