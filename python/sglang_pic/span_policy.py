"""How spans are prefilled and how much of each a request recomputes: the span quality settings, in one place.

A span prefilled on its own starts a fresh sequence, so on a model never fine-tuned for block attention its first
token becomes an extra attention sink, and none of its tokens saw the prompt. Two settings recover most of what
full attention answers, and both keep the shared KV one unmodified copy:
  anchor       the span job prefills the span behind fixed tokens (by default the chat template's opening, where
               a document in a user message would sit), so no span token plays a sequence start. The anchor's KV
               is not part of the span; the anchor is part of the span's radix namespace.
  head_tokens  every request recomputes each span's first k tokens with full attention over everything before
               them, into its own slots, and reads the rest of the span from the shared copy (EPIC's LegoLink).
  tail_tokens  likewise its last k tokens: with a head, the span's two seams (HYPIC).
  recompute    one span only: the exact (offset, length) runs of its tokens to recompute, chosen by the client
               (a selector that scored the span's tokens for this request), over head and tail.
  query_share  the engine chooses such runs itself, per request: the request also recomputes this share of its
               span tokens, those its selection pass scores highest (`select`, per span; each pass fills the
               budget of the spans it scores):
                 query      a probe pass runs the text after the last span over the reused span KV and scores the
                            span tokens its queries attend to most (ProphetKV; managers/span_probe.py);
                 deviation  a pass through the first layers computes every prompt token with full attention and
                            scores each span token by how far its KV there is from the shared copy (CacheBlend;
                            managers/span_deviation.py);
                 lexical    no pass: whole spans, those sharing the question's rarest words, best first, at least
                            the best one (managers/span_lexical.py).
  attention temperature and scale: APE's reweighting, with no recompute, of the attention a request's own
               tokens pay to the span KV it reads (kernels/paged_layout.py, SpanScaling). APE weighs the spans
               as one group; with per-span factors, the spans with equal factors form one group each.
The anchor may also be the prompt's own prefix (`prefix`: the span is keyed on it, so it is shared only behind
that prefix, which is SGLang's parallel encoding). A span can carry its own settings in the prompt text
(`split_settings`), over the request's, which are over the server's.
With either on, a span's KV only ever comes from its span job: a request cannot compute it in its own row, since
the anchor is not there and the request's own head differs from the one the shared tail was computed behind.
Both need the radix cache and one-token pages. `none` (no anchor, k = 0) keeps spans isolated, the setting for
block-attention fine-tuned models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The recommended head for ordinary models: the cheapest setting of benchmark/bench_span_quality.py within one point
# of dense attention on every task family (docs/results.md, span quality frontier).
DEFAULT_HEAD_TOKENS = 128
ANCHOR_CHOICES = ("auto", "none", "prefix")  # the server flag also takes any other text: the anchor itself
ATTENTION_FIELDS = ("span_attention_temperature", "span_attention_scale")
SELECT_CHOICES = ("query", "deviation", "lexical")
SETTING_FIELDS = ("span_anchor", "span_head_tokens", "span_tail_tokens", "span_query_share", "span_select",
                  *ATTENTION_FIELDS)
SPAN_FIELDS = (*SETTING_FIELDS, "span_recompute")  # a span's own settings: the request's, and its exact runs
_SENTINEL = "\u2063sglang-pic-span\u2063"
MAX_ATTENTION_FACTOR = 16.0  # past this a temperature or scale only flattens or saturates the softmax
# Distinct APE factor pairs in one request: each is an attention group, one more kernel pass per layer (and on
# FlashInfer one more planned wrapper with a workspace of its own).
MAX_SPAN_GROUPS = 4


@dataclass(frozen=True)
class SpanPolicy:
    anchor: tuple[int, ...] = ()
    head_tokens: int = 0
    anchor_is_prefix: bool = False  # the anchor is each prompt's prefix segment, whatever it holds
    tail_tokens: int = 0
    runs: tuple[tuple[int, int], ...] | None = None  # a span's own `span_recompute`, over head and tail
    query_share: float = 0.0  # of the span's tokens, recomputed where the request's question attends most
    attention: tuple[float, float] = (1.0, 1.0)  # APE temperature and scale for reading the span
    select: str = "query"  # how the request chooses the span's query_share of tokens (SELECT_CHOICES)

    @property
    def from_job(self) -> bool:
        return bool(self.anchor) or self.anchor_is_prefix or self.head_tokens > 0 or self.tail_tokens > 0 \
            or bool(self.runs) or self.query_share > 0

    def recompute_runs(self, length: int) -> tuple[tuple[int, int], ...]:
        """The tokens of a span of `length` that a request recomputes, as (offset, length) runs (the segment
        normalizes them: runs past the span are cut, overlapping ones merged)."""
        if self.runs is not None:
            return self.runs
        return ((0, self.head_tokens), (max(length - self.tail_tokens, 0), self.tail_tokens))

    def anchor_for(self, prefix: tuple[int, ...]) -> tuple[int, ...]:
        return prefix if self.anchor_is_prefix else self.anchor


def check_settings(settings: Mapping[str, Any]) -> None:
    """Refuse a setting (one of SPAN_FIELDS; a None value: not given) with a ValueError naming the field. Requests
    and the server carry SETTING_FIELDS only, so only a span's own settings can hold span_recompute."""
    for name, value in settings.items():
        if name not in SPAN_FIELDS:
            raise ValueError(f"unknown span setting {name!r}; a span takes {', '.join(SPAN_FIELDS)}")
        if value is None:
            continue
        if name == "span_anchor" and value not in ANCHOR_CHOICES:
            raise ValueError(f"span_anchor must be one of {', '.join(ANCHOR_CHOICES)}, got {value!r}")
        if name == "span_recompute" and not _is_runs(value):
            raise ValueError(f"span_recompute must be a list of [offset, length] pairs of integers, got {value!r}")
        if name in ("span_head_tokens", "span_tail_tokens") and (type(value) is not int or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if name == "span_query_share" and (type(value) not in (int, float) or not 0 <= value <= 1):
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if name == "span_select" and value not in SELECT_CHOICES:
            raise ValueError(f"span_select must be one of {', '.join(SELECT_CHOICES)}, got {value!r}")
        if name in ATTENTION_FIELDS and (type(value) not in (int, float) or not 0 < value <= MAX_ATTENTION_FACTOR):
            raise ValueError(f"{name} must be a number in (0, {MAX_ATTENTION_FACTOR}], got {value!r}")


def _is_runs(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(run, (list, tuple)) and len(run) == 2 and all(type(x) is int and x >= 0 for x in run)
        for run in value
    )


def format_settings(settings: Mapping[str, Any]) -> str:
    """A span's own settings (SPAN_FIELDS; None: not given) as the JSON object after its settings marker."""
    return json.dumps({k: v for k, v in settings.items() if v is not None}, separators=(",", ":"))


def split_settings(body: str, marker: str) -> tuple[dict[str, Any] | None, str]:
    """A span's text after its marker as (its own settings, its text): settings are `marker` then a JSON object
    of SPAN_FIELDS (values are checked where the request's are)."""
    if not body.startswith(marker):
        return None, body
    try:
        settings, end = json.JSONDecoder().raw_decode(body, len(marker))
    except json.JSONDecodeError as e:
        raise ValueError(f"a span's settings after {marker!r} are not JSON: {e.msg}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"a span's settings after {marker!r} must be a JSON object, got {settings!r}")
    check_settings({name: None for name in settings})
    return settings, body[end:]


def model_anchor(tokenizer) -> tuple[int, ...]:
    """The automatic anchor: the tokens a user message's text follows in the model's chat template (system turn
    and user header), else the tokenizer's BOS, else none."""
    template = getattr(tokenizer, "chat_template", None)
    text = ""
    if template:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
        text = rendered[: rendered.find(_SENTINEL)] if _SENTINEL in rendered else ""
    return tuple(tokenizer.encode(text, add_special_tokens=True))


def anchor_tokens(choice: str, tokenizer) -> tuple[int, ...]:
    """The anchor a --span-anchor / span_anchor value names (`prefix`: none fixed, see SpanPolicy)."""
    if choice in ("none", "prefix") or tokenizer is None:
        return ()
    if choice == "auto":
        return model_anchor(tokenizer)
    return tuple(tokenizer.encode(choice, add_special_tokens=True))
