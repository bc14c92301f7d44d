"""Span-quality scores per task and mode: accuracy against the gold answers; agreement with the dense answers (same
`judge` key); the first token's top-1 agreement with dense and KL(dense || mode) of its distribution; computed
prefill tokens per request and the extra over naive spans; the share of span tokens the requests recomputed
(meta_info's recomputed_span_tokens over the prompts' span tokens; dense attends every document token fully, so
its share is 1). The KL is over dense's top-K first tokens plus one bucket for the rest of the vocabulary (each
mode returns its logprobs of those ids via token_ids_logprob): a lower bound on the full KL that is exact when the
top K hold all of dense's mass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sglang_pic.span_quality.items import Item
from sglang_pic.span_quality.modes import BASELINE, REFERENCE
from sglang_pic.span_quality.prompts import Workload
from sglang_pic.span_quality.runner import ModeRun, Record


@dataclass
class TaskModeResult:
    samples: int
    accuracy: float
    agreement_with_dense: float | None
    first_token_top1_agreement: float | None
    first_token_kl: float | None
    prompt_tokens_per_request: float
    computed_prefill_tokens_per_request: float
    extra_prefill_tokens_per_request: float | None
    span_tokens_per_request: float
    recomputed_span_share: float  # recomputed span tokens over span tokens, all requests together
    wall_s: float
    accuracy_by_depth: dict[str, float] | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)


def first_token_kl(ref: dict[int, float], other: dict[int, float]) -> float:
    """KL(ref || other) over ref's top-K ids plus one bucket for the rest of the vocabulary."""
    p = np.exp(np.array([ref[t] for t in sorted(ref)]))
    q = np.exp(np.array([other[t] for t in sorted(ref)]))
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-12)
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-30)) - np.log(np.maximum(q, 1e-30)))))
    return max(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0), 0.0)


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else float("nan")


def _share(part: int, whole: int) -> float:
    return part / whole if whole else float("nan")


def summarize(
    records: list[Record], items: list[Item], wall: float, reference: list[Record] | None,
    baseline: list[Record] | None, examples: int,
) -> TaskModeResult:
    computed = _mean([r.computed_tokens for r in records])
    result = TaskModeResult(
        samples=len(records),
        accuracy=_mean([r.correct for r in records]),
        agreement_with_dense=None,
        first_token_top1_agreement=None,
        first_token_kl=None,
        prompt_tokens_per_request=_mean([r.prompt_tokens for r in records]),
        computed_prefill_tokens_per_request=computed,
        extra_prefill_tokens_per_request=(
            computed - _mean([r.computed_tokens for r in baseline]) if baseline is not None else None
        ),
        span_tokens_per_request=_mean([r.span_tokens for r in records]),
        recomputed_span_share=_share(sum(r.recomputed_span_tokens for r in records),
                                     sum(r.span_tokens for r in records)),
        wall_s=wall,
        examples=[{"reply": r.reply, "gold": asdict(i.gold), "correct": r.correct}
                  for r, i in zip(records[:examples], items)],
    )
    if reference is not None:
        result.agreement_with_dense = _mean([r.key == d.key for r, d in zip(records, reference)])
        result.first_token_top1_agreement = _mean([r.first_token == d.first_token for r, d in zip(records, reference)])
        result.first_token_kl = _mean([first_token_kl(d.first_logprobs, r.first_logprobs)
                                       for r, d in zip(records, reference)])
    buckets = sorted({i.bucket for i in items if i.bucket is not None}, key=lambda b: int(b.split("-")[0]))
    if buckets:
        result.accuracy_by_depth = {
            b: _mean([r.correct for r, i in zip(records, items) if i.bucket == b]) for b in buckets
        }
    return result


def results(runs: dict[str, ModeRun], workload: Workload, examples: int = 0) -> dict[str, dict[str, TaskModeResult]]:
    """task -> mode -> its scores, against the reference and baseline modes where they ran."""
    def records(mode: str, task: str) -> list[Record] | None:
        return runs[mode].records[task] if mode in runs else None

    return {
        t: {m: summarize(run.records[t], workload.items[t], run.walls[t], records(REFERENCE, t),
                         records(BASELINE, t), examples)
            for m, run in runs.items()}
        for t in workload.tasks
    }


def mean_over_tasks(scores: dict[str, dict[str, TaskModeResult]], mode: str, name: str) -> float | None:
    """A mode's field `name` averaged over the tasks, each weighing the same (None where a task has none)."""
    values = [getattr(by_mode[mode], name) for by_mode in scores.values()]
    return None if any(v is None for v in values) else _mean(values)


def reference_topk_mass(runs: dict[str, ModeRun], task: str) -> float | None:
    """How much of the reference's first-token distribution its top K hold (where the KL is exact)."""
    if REFERENCE not in runs:
        return None
    return float(np.mean([np.exp(list(r.first_logprobs.values())).sum() for r in runs[REFERENCE].records[task]]))
