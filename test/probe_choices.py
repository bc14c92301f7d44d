"""Recording what probe passes choose (managers/span_probe.py), for tests that compare engines' choices."""

from __future__ import annotations

from collections.abc import Callable

from sglang_pic.managers import span_probe

CHOOSE = span_probe.choose  # the engine's own, whatever a test has patched in since


def recording(made: list, scores_seen: list | None = None) -> Callable:
    """span_probe.choose that also appends each re-keyed prompt it returns to `made` (and, given `scores_seen`, a
    copy of the scores it chose by, so a test that finds two engines choosing apart can tell a scoring difference
    from a near tie)."""

    def choose(segments, scores, select):
        if scores_seen is not None:
            scores_seen.append(scores.copy())
        made.append(CHOOSE(segments, scores, select))
        return made[-1]

    return choose
