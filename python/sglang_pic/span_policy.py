"""How spans are prefilled and how much of each a request recomputes: the span quality settings, in one place.

A span prefilled on its own starts a fresh sequence, so on a model never fine-tuned for block attention its first
token becomes an extra attention sink, and none of its tokens saw the prompt. Two settings recover most of what
full attention answers, and both keep the shared KV one unmodified copy:
  anchor       the span job prefills the span behind fixed tokens (by default the chat template's opening, where
               a document in a user message would sit), so no span token plays a sequence start. The anchor's KV
               is not part of the span; the anchor is part of the span's radix namespace.
  head_tokens  every request recomputes each span's first k tokens with full attention over everything before
               them, into its own slots, and reads the rest of the span from the shared copy (EPIC's LegoLink).
With either on, a span's KV only ever comes from its span job: a request cannot compute it in its own row, since
the anchor is not there and the request's own head differs from the one the shared tail was computed behind.
Both need the radix cache and one-token pages. `none` (no anchor, k = 0) keeps spans isolated, the setting for
block-attention fine-tuned models.
"""

from __future__ import annotations

from dataclasses import dataclass

# The recommended head for ordinary models, from benchmark/bench_span_quality.py (README, span quality table).
DEFAULT_HEAD_TOKENS = 64
ANCHOR_CHOICES = ("auto", "none")  # or any other text: the anchor's text, tokenized as a prompt's start
_SENTINEL = "\u2063sglang-pic-span\u2063"


@dataclass(frozen=True)
class SpanPolicy:
    anchor: tuple[int, ...] = ()
    head_tokens: int = 0

    @property
    def from_job(self) -> bool:
        return bool(self.anchor) or self.head_tokens > 0


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
    """The anchor a --span-anchor / span_anchor value names."""
    if choice == "none" or tokenizer is None:
        return ()
    if choice == "auto":
        return model_anchor(tokenizer)
    return tuple(tokenizer.encode(choice, add_special_tokens=True))
