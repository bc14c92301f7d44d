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


@dataclass
class SampledLogprobs:
    """The logprobs of sampled tokens and the top alternatives, computed on the device when the tokens are sampled
    and read by the host later, with the tokens (overlap scheduling reads a step's tokens after the next launch).

    One gather for the chosen tokens and one topk per distinct count, instead of two host round trips per row;
    rows sharing a count get what a topk of each row alone gives."""

    top_nums: list[int]
    tensors: list[torch.Tensor]  # chosen [R]; then per distinct count k > 0, ascending: values, ids [rows with k, k]

    @classmethod
    def compute(cls, logprobs: torch.Tensor, ids: torch.Tensor, top_nums: list[int]) -> SampledLogprobs:
        """Row i's logprob of ids[i] and its top_nums[i] best tokens, from log-softmaxed rows."""
        if ids.shape[0] != logprobs.shape[0] or len(top_nums) != logprobs.shape[0]:
            raise ValueError(f"{ids.shape[0]} ids and {len(top_nums)} counts for {logprobs.shape[0]} rows")
        tensors = [logprobs.gather(1, ids.view(-1, 1).to(logprobs.device)).view(-1)]
        for k in sorted(set(top_nums) - {0}):
            rows = [i for i, n in enumerate(top_nums) if n == k]
            part = logprobs if len(rows) == len(top_nums) else logprobs[upload(rows, device=logprobs.device)]
            tensors += part.topk(min(k, logprobs.shape[-1]), dim=-1)
        return cls(top_nums, tensors)

    def by_row(self, host: list[torch.Tensor]) -> list[tuple[float, list[tuple[float, int]]]]:
        """(logprob of the chosen token, [(logprob, token_id)] best first) per row, from host copies of `tensors`."""
        tops: list[list[tuple[float, int]]] = [[] for _ in self.top_nums]
        pairs = iter(host[1:])
        for k in sorted(set(self.top_nums) - {0}):
            values, ids = next(pairs).tolist(), next(pairs).tolist()
            for i, v, t in zip((i for i, n in enumerate(self.top_nums) if n == k), values, ids):
                tops[i] = list(zip(v, t))
        return list(zip(host[0].tolist(), tops))


def chosen_and_top_logprobs(
    logprobs: torch.Tensor, ids: list[int], top_nums: list[int]
) -> list[tuple[float, list[tuple[float, int]]]]:
    """Row i's (logprob of ids[i], its top_nums[i] best tokens) for a whole batch, read at once."""
    sampled = SampledLogprobs.compute(logprobs, torch.tensor(ids, dtype=torch.int64), top_nums)
    return sampled.by_row([t.cpu() for t in sampled.tensors])
