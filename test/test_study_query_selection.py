"""benchmark/study_query_selection.py on a tiny model: the probe scores every span token, the chosen share of them is
what the engine recomputes, and the runs it sends are the top-scored tokens; the oracle modes split the spans at the
one holding the gold phrase; the lexical mode picks the span that names the question's rare words."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import study_query_selection as study  # noqa: E402


def test_top_scored_tokens_become_each_spans_runs():
    scores = [[0.1, 0.9, 0.8, 0.0], [0.5, 0.05, 0.7]]
    assert study.select_runs(scores, 4 / 7) == [[(1, 2)], [(0, 1), (2, 1)]]
    assert study.select_runs(scores, 0.0) == [[], []]
    assert study.select_runs(scores, 0.5, "spans") == [[(0, 4)], []]  # the span of the larger summed score
    marked = study.with_runs("a<S>b<P><S>c<P>q", "<S>", "<T>", [[(1, 2)], []])
    assert marked == 'a<S><T>{"span_recompute": [[1, 2]]}b<P><S><T>{"span_recompute": []}c<P>q'


def test_oracle_targets_the_span_that_says_the_gold_phrase():
    from sglang_pic.span_quality.items import Gold, Item

    item = Item("sys", "", Gold(("Oslo",), ("Rome",)))
    runs = study.oracle_runs("a<S>Rome is far<P><S>Oslo is near<P>q", "<S>", "<P>", item, [3, 4])
    assert runs == {"target": [[], [(0, 4)]], "others": [[(0, 3)], []]}
    with pytest.raises(ValueError, match="no span says"):
        study.oracle_runs("a<S>Rome<P>q", "<S>", "<P>", item, [1])


def test_lexical_mode_recomputes_the_span_naming_the_questions_rare_words():
    marked = ("a<S>Orvent Works was founded in Pineford<P><S>Solara Works was founded in Glendale<P>"
              "<S>Velex Works was founded in Thornfield<P>Where was Solara Works founded?")
    assert study.lexical_runs(marked, "<S>", "<P>", [6, 6, 6]) == [[], [(0, 6)], []]
    shared_words_only = marked.replace("Where was Solara Works founded?", "Which works were founded?")
    assert study.lexical_runs(shared_words_only, "<S>", "<P>", [6, 6, 6]) == [[], [], []]
    second_question = marked + "\nSolara Works, Glendale.\nAnd where was Velex Works founded?\n"
    assert study.lexical_runs(second_question, "<S>", "<P>", [6, 6, 6]) == [[], [], [(0, 6)]]


def test_sentence_modes_recompute_the_sentences_naming_the_questions_rare_words():
    docs = ["Orvent Works is old. It was founded in Pineford.", "That firm is new. Solara moved to Glendale."]
    marked = "a" + "".join(f"<S>{d}<P>" for d in docs) + "Where did Solara go?"
    ids = [[ord(c) for c in d] for d in docs]  # one token per character

    def decode(token_ids):
        return "".join(map(chr, token_ids))

    first, second = docs[1].index("Solara moved"), len(docs[1])
    best = study.sentence_runs(marked, "<S>", "<P>", ids, decode, None)
    assert best == [[], [(first, second - first)]]  # the sentence, not its span's other one
    # under a share, sentences of every span, best first (the earlier on ties), while the tokens taken are short of it
    two = marked.replace("Solara go?", "Solara go from Pineford?")
    assert study.sentence_runs(two, "<S>", "<P>", ids, decode, 0.1) == [[(21, 27)], []]
    assert study.sentence_runs(two, "<S>", "<P>", ids, decode, 0.5) == [[(21, 27)], [(first, second - first)]]
    assert study.sentence_runs(marked.replace("Solara go", "they go"), "<S>", "<P>", ids, decode, 0.5) == [[], []]


def test_study_runs_end_to_end(tiny_model_root: Path):
    from tiny_models import build_tiny_model

    model = tiny_model_root / "qwen2_4k"  # a context that holds the task's prompts (test_bench_span_quality's too)
    if not (model / "config.json").is_file():
        build_tiny_model(tiny_model_root, "qwen2", name="qwen2_4k", max_position_embeddings=4096)
    results = study.main(["--model-path", str(model), "--chat-template", "chatml", "--samples", "2",
                          "--tasks", "factual_qa", "--fractions", "0,0.5,1", "--qa-docs", "2", "--qa-pool", "3",
                          "--oracle"])
    rows = results["factual_qa"]
    assert set(rows) == {"dense", "anchor", "anchor+head64", "query0", "query0.5", "query1", "target", "others"}
    # the gold phrase is in exactly one of the two spans: the oracle modes recompute it, or the other one
    for target, others in zip(rows["target"], rows["others"]):
        assert 0 < target["recomputed_share"] < 1
        assert target["recomputed_share"] + others["recomputed_share"] == pytest.approx(1)
    for mode, share in (("query0", 0.0), ("query0.5", 0.5), ("query1", 1.0)):
        assert [r["recomputed_share"] for r in rows[mode]] == pytest.approx([share] * 2, abs=0.01)  # rounded counts
    # every span token recomputed is dense attention over the same ids: the same answers
    assert [r["key"] for r in rows["query1"]] == [r["key"] for r in rows["dense"]]
