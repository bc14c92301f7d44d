"""Log-probabilities returned to clients, and the per-row lookups the output path needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_pic.utils_tensor import upload


def compute_logprobs(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log_softmax over the last dim of the raw logits (no penalties, no filtering).

    `temperatures` ([N, 1], as in SamplingBatchInfo) scales first when the caller wants the distribution that was
    actually sampled from rather than the model's own.
    """
    logits = logits.float()
    if temperatures is not None:
        logits = logits / temperatures
    return torch.log_softmax(logits, dim=-1)


# Per row: (logprob of the chosen token, [(logprob, token_id)] best first, [(logprob, token_id)] of the ids the
# request asked about (token_ids_logprob) or None).
RowLogprobs = tuple[float, list[tuple[float, int]], list[tuple[float, int]] | None]


@dataclass
class SampledLogprobs:
    """The logprobs of sampled tokens, the top alternatives and of ids a request asks about, computed on the device
    when the tokens are sampled and read by the host later, with the tokens (overlap scheduling reads a step's
    tokens after the next launch).

    One gather for the chosen tokens, one topk per distinct count and one column gather per distinct id list,
    instead of host round trips per row; rows sharing a count get what a topk of each row alone gives."""

    top_nums: list[int]
    token_ids: list[tuple[int, ...] | None]
    # chosen [R]; per distinct count k > 0, ascending: values, ids [rows with k, k]; per distinct id list, in order of
    # first use: values [rows with it, len(list)]
    tensors: list[torch.Tensor]

    @classmethod
    def compute(
        cls,
        logprobs: torch.Tensor,
        ids: torch.Tensor,
        top_nums: list[int],
        token_ids: list[list[int] | None] | None = None,
    ) -> SampledLogprobs:
        """Row i's logprob of ids[i], its top_nums[i] best tokens and its logprobs of token_ids[i], from
        log-softmaxed rows."""
        token_ids = token_ids if token_ids is not None else [None] * len(top_nums)
        wanted = [None if t is None else tuple(t) for t in token_ids]
        if ids.shape[0] != logprobs.shape[0] or len(top_nums) != logprobs.shape[0] or len(wanted) != len(top_nums):
            raise ValueError(f"{ids.shape[0]} ids, {len(top_nums)} counts, {len(wanted)} id lists for "
                             f"{logprobs.shape[0]} rows")
        tensors = [logprobs.gather(1, ids.view(-1, 1).to(logprobs.device)).view(-1)]
        for k in sorted(set(top_nums) - {0}):
            tensors += _rows(logprobs, [n == k for n in top_nums]).topk(min(k, logprobs.shape[-1]), dim=-1)
        for cols in dict.fromkeys(w for w in wanted if w is not None):
            tensors.append(_rows(logprobs, [w == cols for w in wanted])[:, upload(list(cols), device=logprobs.device)])
        return cls(top_nums, wanted, tensors)

    def by_row(self, host: list[torch.Tensor]) -> list[RowLogprobs]:
        """Each row's logprobs, from host copies of `tensors`."""
        tops: list[list[tuple[float, int]]] = [[] for _ in self.top_nums]
        asked: list[list[tuple[float, int]] | None] = [None] * len(self.top_nums)
        parts = iter(host[1:])
        for k in sorted(set(self.top_nums) - {0}):
            values, ids = next(parts).tolist(), next(parts).tolist()
            for i, v, t in zip((i for i, n in enumerate(self.top_nums) if n == k), values, ids):
                tops[i] = list(zip(v, t))
        for cols in dict.fromkeys(w for w in self.token_ids if w is not None):
            values = next(parts).tolist()
            for i, v in zip((i for i, w in enumerate(self.token_ids) if w == cols), values):
                asked[i] = list(zip(v, cols))
        return list(zip(host[0].tolist(), tops, asked))


def _rows(logprobs: torch.Tensor, take: list[bool]) -> torch.Tensor:
    """The rows of `logprobs` where `take` holds (all of them without a copy)."""
    if all(take):
        return logprobs
    return logprobs[upload([i for i, t in enumerate(take) if t], device=logprobs.device)]


def chosen_and_top_logprobs(
    logprobs: torch.Tensor, ids: list[int], top_nums: list[int], token_ids: list[list[int] | None] | None = None
) -> list[RowLogprobs]:
    """Each row's logprobs (see SampledLogprobs) for a whole batch, read at once."""
    sampled = SampledLogprobs.compute(logprobs, torch.tensor(ids, dtype=torch.int64), top_nums, token_ids)
    return sampled.by_row([t.cpu() for t in sampled.tensors])
