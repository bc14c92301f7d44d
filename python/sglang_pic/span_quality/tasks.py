"""The span-quality tasks: prompts whose documents are spans, each with a gold answer, generated from a seed.

Each task writes `Item`s (items.py): a system prompt, a user turn whose documents are marked as spans (or earlier
turns that hold them), optional OpenAI tools and the gold answer. Documents come from a pool shared by the
samples, so they recur as in real retrieval and agent traffic. A module per family says what its items ask:
  factual_qa, multi_turn  company_qa.py
  tool_selection          tool_selection.py
  needle                  needle.py
  late_records            late_records.py
  code_retrieval          code_retrieval.py
  long_spans              long_spans.py
These need nothing but the package, so `python -m sglang_pic.check_span_quality` runs them on any model; the full
benchmark (benchmark/bench_span_quality.py) adds a RAG task of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_pic.span_quality.code_retrieval import code_retrieval
from sglang_pic.span_quality.company_qa import factual_qa, multi_turn
from sglang_pic.span_quality.items import CountTokens, Item
from sglang_pic.span_quality.late_records import late_records
from sglang_pic.span_quality.long_spans import long_spans
from sglang_pic.span_quality.needle import needle
from sglang_pic.span_quality.sizes import TaskSizes
from sglang_pic.span_quality.tool_selection import tool_selection


@dataclass(frozen=True)
class Task:
    name: str
    max_new_tokens: int
    make: Callable[[int, int, TaskSizes, CountTokens], list[Item]]  # (samples, seed, sizes, count) -> items


TASKS = {
    t.name: t
    for t in (
        Task("factual_qa", 16, factual_qa),
        Task("tool_selection", 56, tool_selection),
        Task("needle", 12, needle),
        Task("late_records", 16, late_records),
        Task("code_retrieval", 16, code_retrieval),
        Task("long_spans", 32, long_spans),
        Task("multi_turn", 16, multi_turn),
    )
}
