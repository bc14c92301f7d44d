"""SGLang's parallel encoding joins matched by text (managers/parallel_encoding.py), without a model."""

from __future__ import annotations

import pytest

from sglang_pic.managers import parallel_encoding
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.parallel_encoding import ParallelEncoding
from sglang_pic.server_args import ServerArgs

P = "USER: memorize these.\n"
STATEMENTS = ["Statement 0: Ann is tall.\n", "Statement 1: Bob is short.\n", "Statement 2: Cy is tall.\n"]
OPEN = '<|ssep|><|span_settings|>{"span_anchor":"prefix"}'


@pytest.fixture
def joins() -> ParallelEncoding:
    pe = ParallelEncoding(ServerArgs())
    for s in STATEMENTS:  # what SGLang's client commits for each fork
        send(pe, P + s, 0)
    return pe


def send(pe: ParallelEncoding, text: str | list[str], max_new_tokens: int = 8) -> str | list[str]:
    obj = GenerateReqInput(text=text, sampling_params={"max_new_tokens": max_new_tokens})
    pe.apply(obj)
    return obj.text


def test_a_join_marks_the_destination_prompt_once(joins):
    dst = P + "".join(STATEMENTS) + "Who is tall?"
    assert send(joins, dst) == dst  # no join announced: a plain prompt stays plain
    joins.expect_join(["a", "b", "c"])
    assert send(joins, dst) == P + "".join(OPEN + s for s in STATEMENTS) + "<|pdep|>Who is tall?"
    assert send(joins, dst) == dst  # the join is used up


def test_statements_in_another_order_and_a_trailing_join(joins):
    joins.expect_join(["a", "b"])
    dst = P + STATEMENTS[2] + STATEMENTS[0]
    assert send(joins, [dst, "other"]) == [P + OPEN + STATEMENTS[2] + OPEN + STATEMENTS[0], "other"]


def test_only_a_prompt_with_as_many_statements_as_forks_is_marked(joins):
    joins.expect_join(["a", "b", "c"])
    two = P + STATEMENTS[0] + STATEMENTS[1] + "Who?"
    assert send(joins, two) == two
    marked = '<|ssep|>x<|pdep|>' + P + "".join(STATEMENTS)
    assert send(joins, marked) == marked  # already marked prompts are the user's own structure
    assert joins.joins  # still pending


def test_unmatched_joins_expire(joins, monkeypatch):
    joins.expect_join(["a", "b", "c"])
    now = parallel_encoding.time.monotonic()
    monkeypatch.setattr(parallel_encoding.time, "monotonic", lambda: now + parallel_encoding.JOIN_TTL_S + 1)
    dst = P + "".join(STATEMENTS) + "Who?"
    assert send(joins, dst) == dst and not joins.joins


def test_commits_are_bounded(monkeypatch):
    monkeypatch.setattr(parallel_encoding, "MAX_COMMITS", 4)
    pe = ParallelEncoding(ServerArgs())
    for i in range(10):
        send(pe, f"text {i}", 0)
    assert list(pe.commits) == [f"text {i}" for i in range(6, 10)]


@pytest.mark.parametrize("bad", [[], "a", [1]])
def test_bad_joins_are_refused(bad):
    with pytest.raises(ValueError, match="src_rids"):
        ParallelEncoding(ServerArgs()).expect_join(bad)
