"""Span markers as text: build marker-aware prompts for the server, with or without SGLang's frontend.

`span(doc)` yields `SSEP + doc + PDEP`: the closing PDEP marker makes whatever text follows a span prompt-dependent
by default (it attends to, and is keyed on, everything before it). Consecutive spans leave empty PDEP segments
between them, which the server drops. `pdep()` starts prompt-dependent text explicitly. `span(doc, anchor=...,
head_tokens=...)` gives one span its own quality settings (sglang_pic/span_policy.py) over the request's: they
travel as a settings marker and a JSON object right after the span marker.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields

from sglang_pic.span_policy import check_settings, format_settings

SSEP_MARKER = "<|ssep|>"
PDEP_MARKER = "<|pdep|>"
SPAN_SETTINGS_MARKER = "<|span_settings|>"
# A settings object is JSON of strings, numbers and lists of numbers, so it holds no "}" of its own.
_MARKUP = "|".join([re.escape(SPAN_SETTINGS_MARKER) + r"\{[^}]*\}", re.escape(SSEP_MARKER), re.escape(PDEP_MARKER)])


def _check_text(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    for marker in (SSEP_MARKER, PDEP_MARKER, SPAN_SETTINGS_MARKER):
        if marker in text:
            raise ValueError(f"{what} contains the marker {marker!r}; markers are structure, not text")
    return text


def span(
    text: str,
    *,
    anchor: str | None = None,
    head_tokens: int | None = None,
    tail_tokens: int | None = None,
    query_share: float | None = None,
    select: str | None = None,
    attention_temperature: float | None = None,
    attention_scale: float | None = None,
    recompute: Sequence[tuple[int, int]] | None = None,
) -> str:
    """A reusable span: its KV depends only on `text` (and its anchor), so it is computed once and reused at any
    offset. `anchor` (auto, none or prefix), `head_tokens`, `tail_tokens`, `query_share`, `select` (query,
    deviation or lexical) and APE's `attention_temperature` and `attention_scale` override the request's span
    settings for this span; `recompute`, (offset, length) runs of the span's tokens, names exactly which ones this
    request recomputes."""
    if not _check_text(text, "span text"):
        raise ValueError("span text is empty")
    settings = {"span_anchor": anchor, "span_head_tokens": head_tokens, "span_tail_tokens": tail_tokens,
                "span_query_share": query_share, "span_select": select,
                "span_attention_temperature": attention_temperature, "span_attention_scale": attention_scale,
                "span_recompute": None if recompute is None else [list(run) for run in recompute]}
    check_settings(settings)
    given = any(v is not None for v in settings.values())
    own = SPAN_SETTINGS_MARKER + format_settings(settings) if given else ""
    return SSEP_MARKER + own + text + PDEP_MARKER


def pdep(text: str = "") -> str:
    """Prompt-dependent text: attends to the whole prompt before it."""
    return PDEP_MARKER + _check_text(text, "pdep text")


@dataclass(frozen=True)
class Span:
    text: str
    anchor: str | None = None
    head_tokens: int | None = None
    tail_tokens: int | None = None
    query_share: float | None = None
    select: str | None = None
    attention_temperature: float | None = None
    attention_scale: float | None = None


def marked_prompt(*parts: str | Span) -> str:
    """Join plain strings and `Span(...)` parts into one marked prompt (no SGLang needed)."""
    out = []
    for part in parts:
        if isinstance(part, Span):
            settings = {f.name: getattr(part, f.name) for f in fields(Span) if f.name != "text"}
            out.append(span(part.text, **settings))
        else:
            out.append(_check_text(part, "prompt text"))
    return "".join(out)


def strip_markers(text: str) -> str:
    """The prompt as plain text (what a PIC-unaware engine would see)."""
    return re.sub(_MARKUP, "", text)
