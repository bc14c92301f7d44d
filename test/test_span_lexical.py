"""Lexically selected recompute (span_select lexical, managers/span_lexical.py): which spans a request recomputes,
and that the engine serves it exactly as the same prompt with those spans' runs given by the client."""

from __future__ import annotations

import pytest

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.span_lexical import SpanWords, choose_lexical
from sglang_pic.radix_ext.segments import Segment
from test_span_policy import PARAMS

WORDS = ["orvent", "works", "was", "founded", "in", "pineford", "solara", "glendale", "velex", "thornfield", "where",
         "\n", "which", "and"]


def decode(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def ids(text: str) -> tuple[int, ...]:
    return tuple(WORDS.index(w) for w in text.replace("\n", " \n ").split(" ") if w)


def lexical_span(text: str, share: float = 0.1) -> Segment:
    return Segment("span", ids(text), query_share=share, select="lexical")


SPANS = [lexical_span("orvent works was founded in pineford"), lexical_span("solara works was founded in glendale"),
         lexical_span("velex works was founded in thornfield")]


def recomputed(segments: list[Segment]) -> list[bool]:
    return [bool(s.recompute) for s in segments if s.kind == "span"]


def test_the_span_naming_the_questions_rare_words_is_recomputed_whole():
    out = choose_lexical([Segment("prefix", ids("which")), *SPANS, Segment("pdep", ids("where was solara founded"))],
                         SpanWords(decode))
    assert recomputed(out) == [False, True, False]
    assert out[2].recompute == ((0, len(SPANS[1].token_ids)),)
    assert all(s.query_share == 0 for s in out if s.kind == "span")  # chosen: no pass runs for them


def test_the_latest_question_line_chooses_and_shared_words_choose_nothing():
    conversation = Segment("pdep", ids("where was solara founded \n glendale \n and velex"))
    assert recomputed(choose_lexical([*SPANS, conversation], SpanWords(decode))) == [False, False, True]
    template_only = Segment("pdep", ids("where was works founded"))
    assert recomputed(choose_lexical([*SPANS, template_only], SpanWords(decode))) == [False, False, False]


def test_spans_are_taken_best_first_until_the_share():
    question = Segment("pdep", ids("solara in pineford"))  # solara and pineford weigh alike: the earlier span first
    assert recomputed(choose_lexical([*SPANS, question], SpanWords(decode))) == [True, False, False]
    wide = [lexical_span(decode(list(s.token_ids)), share=0.5) for s in SPANS]
    assert recomputed(choose_lexical([*wide, question], SpanWords(decode))) == [True, True, False]


def test_other_selectors_spans_keep_their_share():
    query_span = Segment("span", SPANS[1].token_ids, query_share=0.2, select="query")
    out = choose_lexical([SPANS[0], query_span, Segment("pdep", ids("where was solara founded"))], SpanWords(decode))
    assert out[1] == query_span and recomputed(out) == [False, False]


def test_a_spans_words_are_decoded_once_while_it_recurs():
    decoded = []
    span_words = SpanWords(lambda ids: decoded.append(tuple(ids)) or decode(ids), size=2)
    question = Segment("pdep", ids("where was solara founded"))
    for _ in range(3):
        assert recomputed(choose_lexical([*SPANS[:2], question], span_words)) == [False, True]
    assert decoded.count(SPANS[0].token_ids) == 1 and decoded.count(SPANS[1].token_ids) == 1
    choose_lexical([SPANS[2], question], span_words)  # a third span pushes out the least recent
    choose_lexical([SPANS[0], question], span_words)
    assert decoded.count(SPANS[0].token_ids) == 2


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096) as e:
        yield e


DOCS = ["Orvent Works was founded in Pineford by the river.", "Solara Works was founded in Glendale by the river.",
        "Velex Works was founded in Thornfield by the river."]


def layout(req) -> list[tuple]:
    """What keys and computes a request's prompt: its segments' kinds, tokens, keys, positions and recomputed runs."""
    return [(s.kind, list(s.tokens), s.extra_key, s.start, s.key_lead, s.span_rest, s.span_runs) for s in req.segments]


def test_the_engine_serves_the_choice_as_the_clients_own_runs(engine: Engine):
    lexical = "Answer briefly." + "".join(span(d) for d in DOCS) + "Where was Solara Works founded?"
    explicit = "Answer briefly." + "".join(
        span(d, recompute=[(0, 10_000)] if "Solara" in d else None) for d in DOCS) + "Where was Solara Works founded?"
    settings = {"span_anchor": "auto", "span_head_tokens": 0}
    (chosen,) = engine.make_reqs(GenerateReqInput(text=lexical, span_query_share=0.1, span_select="lexical",
                                                  **settings))
    (given,) = engine.make_reqs(GenerateReqInput(text=explicit, **settings))
    (plain,) = engine.make_reqs(GenerateReqInput(text=lexical, **settings))
    assert layout(chosen) == layout(given) != layout(plain) and chosen.probe is None
    out = engine.generate(prompt=lexical, sampling_params=PARAMS, span_query_share=0.1, span_select="lexical",
                          **settings)
    assert out["output_ids"] == engine.generate(prompt=explicit, sampling_params=PARAMS, **settings)["output_ids"]
