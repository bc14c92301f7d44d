"""The span-quality benchmark's tasks: the package's (sglang_pic/span_quality/tasks.py: factual_qa, tool_selection,
needle, late_records, code_retrieval, long_spans, multi_turn) plus rag_two_hop, which needs this folder's RAG
workload:
  rag_two_hop     rag_workload.py's 2WikiMultihopQA-shaped passages and questions, with its gold answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from rag_workload import WorkloadConfig, build_workload

from sglang_pic.span_quality.items import CountTokens, Gold, Item, question_block, spans
from sglang_pic.span_quality.sizes import TaskSizes
from sglang_pic.span_quality.tasks import TASKS as PACKAGE_TASKS
from sglang_pic.span_quality.tasks import Task


@dataclass(frozen=True)
class BenchTaskSizes(TaskSizes):
    """The package's task sizes plus the RAG task's."""

    rag_passages: int = 4
    rag_corpus: int = 60
    rag_passage_tokens: tuple[int, int] = (50, 90)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rag_passages < 1 or self.rag_corpus < self.rag_passages:
            raise ValueError("task sizes: rag_corpus < rag_passages (or a size below 1)")


def rag_two_hop(samples: int, seed: int, sizes: BenchTaskSizes, count: CountTokens) -> list[Item]:
    cfg = WorkloadConfig(num_samples=samples, num_passages=sizes.rag_passages, corpus_size=sizes.rag_corpus,
                         passage_tokens=sizes.rag_passage_tokens, seed=seed)
    work = build_workload(cfg, count)
    return [
        Item(cfg.system_prompt, spans(work.passages(s)) + question_block(s.question),
             Gold(s.gold.phrases, s.gold.rivals))
        for s in work.samples
    ]


TASKS: dict[str, Task] = {**PACKAGE_TASKS, "rag_two_hop": Task("rag_two_hop", 24, rag_two_hop)}
