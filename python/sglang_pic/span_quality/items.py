"""What every span-quality task writes: `Item`s with gold answers, drawn from a seed of a split.

Every task draws from a generator seed of a split (`item_seed`): settings are chosen on `tuning` items and
reported on `heldout` ones, whose seeds lie in a disjoint range. The same seed always gives the same items.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from sglang_pic.frontend_lang.markers import span

CountTokens = Callable[[str], int]  # the model tokenizer's length of a text, without special tokens


@dataclass(frozen=True)
class Gold:
    """A right answer says every phrase of `phrases`; where the question has `rivals` (other documents' values,
    "no" against "yes") it says a gold phrase before any rival."""

    phrases: tuple[str, ...]
    rivals: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolGold:
    """A right reply calls `name` with JSON-object arguments that hold every key of `required`."""

    name: str
    required: tuple[str, ...]


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant", as in an OpenAI chat message
    content: str


@dataclass(frozen=True)
class Item:
    system: str
    user: str  # the last user turn: documents marked as spans, or a question about earlier turns' documents
    gold: Gold | ToolGold
    tools: tuple[dict, ...] = ()  # OpenAI tools, rendered by the chat template
    bucket: str | None = None  # the asked fact's depth bucket (needle, long_spans)
    earlier: tuple[Turn, ...] = ()  # turns between the system prompt and `user`, rendered by the chat template


SPLITS = ("tuning", "heldout")  # choose settings on tuning items, report them on held-out ones


def item_seed(seed: int, task: str, split: str) -> int:
    """A task's generator seed in `split`: independent of which other tasks run, so a subset draws the same items;
    tuning seeds lie in [0, 2**32) and held-out ones in [2**32, 2**33), so the splits never share a seed."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    digest = hashlib.sha256(f"{seed}/{task}".encode()).digest()[:4]
    return SPLITS.index(split) << 32 | int.from_bytes(digest, "little")


def question_block(question: str) -> str:
    """How every task puts its question after the documents."""
    return f"Question: {question}"


def spans(docs: list[str]) -> str:
    """Documents as consecutive spans, as every task gives them."""
    return "".join(span(d) for d in docs)


def depth_bucket(position: int, positions: int, buckets: int) -> str:
    """An item's `bucket`: which of `buckets` equal depth ranges `position` of `positions` falls in."""
    b = position * buckets // positions
    return f"{100 * b // buckets}-{100 * (b + 1) // buckets}%"


MAX_ATTEMPTS_PER_ITEM = 100


def draw(samples: int, attempt: Callable[[], Item | None]) -> list[Item]:
    """`samples` items from attempts, each of which may find none (documents that allow no clean question); sizes
    that leave almost no clean question are refused rather than drawn from forever."""
    items: list[Item] = []
    for _ in range(samples * MAX_ATTEMPTS_PER_ITEM):
        if len(items) == samples:
            return items
        item = attempt()
        if item is not None:
            items.append(item)
    if len(items) < samples:
        raise ValueError(f"task sizes allow too few clean questions: {len(items)} of {samples} items drawn")
    return items
