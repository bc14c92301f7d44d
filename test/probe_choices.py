"""Recording what probe passes choose (managers/span_probe.py), for tests that compare engines' choices."""

from __future__ import annotations

from collections.abc import Callable

from sglang_pic.managers import span_probe

CHOOSE = span_probe.choose  # the engine's own, whatever a test has patched in since


def recording(made: list) -> Callable:
    """span_probe.choose that also appends each re-keyed prompt it returns to `made`."""

    def choose(segments, scores, select):
        made.append(CHOOSE(segments, scores, select))
        return made[-1]

    return choose
