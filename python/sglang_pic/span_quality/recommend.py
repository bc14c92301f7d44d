"""Which span setting the quick check recommends: the settings it tries, their scores averaged over the tasks, and
the rule it picks by (the rule the server's default was chosen by: docs/results.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_pic.span_quality.modes import BASELINE, MODES, REFERENCE, Mode, span_mode, span_mode_name
from sglang_pic.span_quality.scoring import TaskModeResult, mean_over_tasks


@dataclass(frozen=True)
class SettingScore:
    """One span setting's scores, averaged over the tasks (each task weighs the same)."""

    name: str
    mode: Mode
    agreement: float  # answers that agree with dense attention's
    top1: float  # first tokens that agree with dense attention's
    extra_tokens: float  # prefill tokens computed per request beyond isolated spans'
    accuracy: float  # answers that are right
    recomputed_share: float  # span tokens recomputed with full attention
    worst_gap: float  # the most any task's accuracy falls below dense attention's


@dataclass(frozen=True)
class Recommendation:
    pick: SettingScore  # chosen on the tuning items
    heldout: SettingScore  # the same setting on the held-out items


RULE = (
    "the cheapest setting (fewest extra prefill tokens) whose accuracy on every task is within {tol:g} of dense "
    "attention's; when none is, the one whose worst task falls least below dense"
)


def recommend(scores: Sequence[SettingScore], tolerance: float) -> SettingScore:
    """By RULE; between equally cheap ones the one closer to dense, then the more agreeing, then the earlier."""
    fits = [s for s in scores if s.worst_gap <= tolerance + 1e-9]  # 1e-9: 0.80 - 0.79 is 0.0100...
    if not fits:
        return min(scores, key=lambda s: (s.worst_gap, s.extra_tokens))
    return min(fits, key=lambda s: (s.extra_tokens, s.worst_gap, -s.agreement))


def settings(head_tokens: Sequence[int], seam_tokens: Sequence[int] = (),
             lexical_shares: Sequence[float] = ()) -> dict[str, Mode]:
    """dense (the reference), isolated spans (the cost baseline), then the anchor with each head length, with each
    seams length and with each query share chosen lexically."""
    tried = [("auto", k, 0) for k in head_tokens] + [("auto", k, k) for k in seam_tokens]
    tried += [("auto", 0, 0, share, 1.0, 1.0, "lexical") for share in lexical_shares]
    anchored = {span_mode_name(*s): span_mode(*s) for s in tried}
    return {REFERENCE: MODES[REFERENCE], BASELINE: MODES[BASELINE], **anchored}


def setting_scores(scores: dict[str, dict[str, TaskModeResult]], modes: dict[str, Mode]) -> list[SettingScore]:
    def mean(name: str, field: str) -> float:
        return mean_over_tasks(scores, name, field)

    def worst_gap(name: str) -> float:
        return max(by_mode[REFERENCE].accuracy - by_mode[name].accuracy for by_mode in scores.values())

    return [SettingScore(name, mode, mean(name, "agreement_with_dense"), mean(name, "first_token_top1_agreement"),
                         mean(name, "extra_prefill_tokens_per_request"), mean(name, "accuracy"),
                         mean(name, "recomputed_span_share"), worst_gap(name))
            for name, mode in modes.items() if name != REFERENCE]
