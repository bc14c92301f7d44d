"""The span-quality task generators, without running a model: the same seed draws the same items (in another
process too), tuning and held-out seeds are disjoint, every gold answer is said by exactly the document meant to
hold it (and by no question or earlier turn), a late record field starts past the first 64 tokens of its record,
and long spans are as long as asked. Tokens are counted with the tiny Qwen2's tokenizer, as the benchmark counts
with its model's."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_bench_span_quality import qwen2_with_tools

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from span_quality_tasks import TASKS, BenchTaskSizes  # noqa: E402

from sglang_pic.frontend_lang.markers import PDEP_MARKER, SSEP_MARKER  # noqa: E402
from sglang_pic.span_quality.code_retrieval import stdlib_functions  # noqa: E402
from sglang_pic.span_quality.items import SPLITS, Gold, Item, item_seed  # noqa: E402
from sglang_pic.span_quality.judging import says  # noqa: E402
from sglang_pic.span_quality.late_records import LATE_AFTER  # noqa: E402
from sglang_pic.span_quality.prompts import PromptBuilder  # noqa: E402
from sglang_pic.span_quality.sizes import TaskSizes  # noqa: E402

SAMPLES = 12
SIZES = BenchTaskSizes()


@pytest.fixture(scope="module")
def model_dir(tiny_model_root) -> Path:
    return qwen2_with_tools(tiny_model_root)[0]


@pytest.fixture(scope="module")
def count(model_dir) -> Callable[[str], int]:
    return PromptBuilder(str(model_dir), str(model_dir), None).count


def documents(item: Item) -> list[str]:
    """The texts an item marks as spans, its earlier turns' included."""
    text = "".join(t.content for t in item.earlier) + item.user
    return [part.split(PDEP_MARKER)[0] for part in text.split(SSEP_MARKER)[1:]]


def question(text: str) -> str:
    return text.rsplit("Question: ", 1)[1]


def _first_line(doc: str) -> str:
    return doc.splitlines()[0]


# Which document each task means to hold the gold answer, given the question.
INTENDED: dict[str, Callable[[str, str], bool]] = {
    "factual_qa": lambda q, doc: _first_line(doc) in q,  # the company named
    "multi_turn": lambda q, doc: _first_line(doc) in q,
    "needle": lambda q, doc: _first_line(doc) in ("Archive note", "Library note"),
    "late_records": lambda q, doc: _first_line(doc).split(": ", 1)[1] in q,  # the employee or product named
    "code_retrieval": lambda q, doc: says(doc, q.split('"')[1]),  # the function whose docstring is quoted
    "long_spans": lambda q, doc: _first_line(doc).removeprefix("The chronicle of ") in q,
}


def test_the_same_seed_draws_the_same_items(count):
    for name, task in TASKS.items():
        seed = item_seed(3, name, "heldout")
        assert task.make(4, seed, SIZES, count) == task.make(4, seed, SIZES, count), name


def _digests(model_dir: Path, hash_seeds: list[str]) -> list[str]:
    """Every task's items, hashed, as fresh processes with their own string hashing draw them (side by side)."""
    script = (
        "import hashlib, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'benchmark')!r})\n"
        "from span_quality_tasks import TASKS, BenchTaskSizes\n"
        "from sglang_pic.span_quality.items import item_seed\n"
        "from sglang_pic.span_quality.prompts import PromptBuilder\n"
        f"count = PromptBuilder({str(model_dir)!r}, {str(model_dir)!r}, None).count\n"
        "items = {n: t.make(3, item_seed(0, n, 'tuning'), BenchTaskSizes(), count) for n, t in TASKS.items()}\n"
        "print(hashlib.sha256(repr(items).encode()).hexdigest())\n"
    )
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}) for seed in hash_seeds]
    outs = [run.communicate() for run in runs]
    for run, (_, err) in zip(runs, outs):
        assert run.returncode == 0, err
    return [out.split()[-1] for out, _ in outs]


@pytest.mark.slow  # two fresh processes that import the engine's tokenizing stack
def test_the_same_seed_draws_the_same_items_in_any_process(model_dir, count):
    here = {n: t.make(3, item_seed(0, n, "tuning"), SIZES, count) for n, t in TASKS.items()}
    expected = hashlib.sha256(repr(here).encode()).hexdigest()
    assert _digests(model_dir, ["1", "2"]) == [expected, expected]


def test_tuning_and_heldout_seeds_are_disjoint(count):
    for name, task in TASKS.items():
        tuning = {item_seed(s, name, "tuning") for s in range(50)}
        heldout = {item_seed(s, name, "heldout") for s in range(50)}
        assert max(tuning) < 2**32 <= min(heldout) and max(heldout) < 2**33, name
        assert len(tuning) == len(heldout) == 50, name
        drawn = {split: task.make(6, item_seed(0, name, split), SIZES, count) for split in SPLITS}
        assert not {repr(i) for i in drawn["tuning"]} & {repr(i) for i in drawn["heldout"]}, name
    with pytest.raises(ValueError, match="split"):
        item_seed(0, "needle", "test")


@pytest.mark.parametrize("task", sorted(INTENDED))
def test_every_gold_answer_is_in_exactly_the_intended_document(task, count):
    for item in TASKS[task].make(SAMPLES, item_seed(1, task, "tuning"), SIZES, count):
        docs, q = documents(item), question(item.user)
        assert isinstance(item.gold, Gold) and docs, task
        # besides the documents: the question, and in multi_turn the first question and the assistant's answer
        others = [q, *(question(t.content) if t.role == "user" else t.content for t in item.earlier)]
        for phrase in item.gold.phrases:
            holders = [d for d in docs if says(d, phrase)]
            assert len(holders) == 1, (task, phrase, q)
            assert INTENDED[task](q, holders[0]), (task, phrase, q)
            assert not any(says(text, phrase) for text in others), (task, q)
        for rival in item.gold.rivals:
            assert rival not in item.gold.phrases and not says(holders[0], rival), (task, rival)
            assert any(says(d, rival) for d in docs if d is not holders[0]), (task, rival)


def test_late_record_fields_start_past_a_64_token_head(count):
    assert LATE_AFTER == 64
    for item in TASKS["late_records"].make(SAMPLES, item_seed(2, "late_records", "heldout"), SIZES, count):
        docs = documents(item)
        (holder,) = [d for d in docs if says(d, item.gold.phrases[0])]
        lines = holder.splitlines(keepends=True)
        assert 9 <= len(lines) <= 13, holder  # a heading and 8-12 fields
        at = next(i for i, line in enumerate(lines) if says(line, item.gold.phrases[0]))
        assert count("".join(lines[:at])) >= 64, (holder, at)
        # one template: every other record holds the same field, with a rival value
        label = lines[at].split(": ")[0]
        for doc in docs:
            if doc is not holder:
                value = next(line for line in doc.splitlines() if line.startswith(f"{label}: ")).split(": ", 1)[1]
                assert value in item.gold.rivals, (label, value)


@pytest.mark.parametrize("long_tokens", [(1024, 4096), (200, 400)])
def test_long_spans_are_as_long_as_asked(long_tokens, count):
    sizes = BenchTaskSizes(long_tokens=long_tokens)
    low, high = long_tokens
    buckets = set()
    for item in TASKS["long_spans"].make(SAMPLES, item_seed(0, "long_spans", "tuning"), sizes, count):
        docs = documents(item)
        assert len(docs) == sizes.long_docs
        for doc in docs:
            assert low <= count(doc) <= high, (long_tokens, count(doc))
        buckets.add(item.bucket)
    assert len(buckets) > 1  # the fact sits at different depths


def test_multi_turn_gives_the_documents_in_an_earlier_turn(count):
    for item in TASKS["multi_turn"].make(SAMPLES, item_seed(0, "multi_turn", "tuning"), SIZES, count):
        assert [t.role for t in item.earlier] == ["user", "assistant"]
        assert SSEP_MARKER in item.earlier[0].content and SSEP_MARKER not in item.user
        assert item.user.startswith("Question: ") and item.earlier[1].content


def test_code_documents_are_standard_library_source():
    functions = stdlib_functions()
    assert len({f.name for f in functions}) == len(functions)
    for f in functions:
        assert f.source.startswith("def ") and f.source.endswith("\n"), f.name
        assert f.quote and says(f.source, f.quote) and not says(f.quote, f.name), f.name


def test_bad_sizes_are_refused():
    for bad in ({"long_tokens": (1000, 1100)}, {"long_tokens": (0, 400)}, {"long_docs": 7, "long_pool": 6},
                {"records_docs": 0}, {"code_functions": len(stdlib_functions()) + 1}):
        with pytest.raises(ValueError, match="task sizes"):
            TaskSizes(**bad)
