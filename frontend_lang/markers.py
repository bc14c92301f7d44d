"""Span markers as text: build marker-aware prompts for the server, with or without SGLang's frontend.

`span(doc)` yields `SSEP + doc + PDEP`: the closing PDEP marker makes whatever text follows a span prompt-dependent
by default (it attends to, and is keyed on, everything before it). Consecutive spans leave empty PDEP segments
between them, which the server drops. `pdep()` starts prompt-dependent text explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

SSEP_MARKER = "<|ssep|>"
PDEP_MARKER = "<|pdep|>"


def _check_text(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    for marker in (SSEP_MARKER, PDEP_MARKER):
        if marker in text:
            raise ValueError(f"{what} contains the marker {marker!r}; markers are structure, not text")
    return text


def span(text: str) -> str:
    """A reusable span: its KV depends only on `text`, so it is computed once and reused at any offset."""
    if not _check_text(text, "span text"):
        raise ValueError("span text is empty")
    return SSEP_MARKER + text + PDEP_MARKER


def pdep(text: str = "") -> str:
    """Prompt-dependent text: attends to the whole prompt before it."""
    return PDEP_MARKER + _check_text(text, "pdep text")


@dataclass(frozen=True)
class Span:
    text: str


def marked_prompt(*parts: str | Span) -> str:
    """Join plain strings and `Span(...)` parts into one marked prompt (no SGLang needed)."""
    out = []
    for part in parts:
        out.append(span(part.text) if isinstance(part, Span) else _check_text(part, "prompt text"))
    return "".join(out)


def strip_markers(text: str) -> str:
    """The prompt as plain text (what a PIC-unaware engine would see)."""
    return text.replace(SSEP_MARKER, "").replace(PDEP_MARKER, "")
