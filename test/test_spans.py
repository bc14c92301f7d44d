"""Span caching end to end on the offline Engine: counted reuse, --disable-pic, bad input, SGLang programs."""

from __future__ import annotations

import pytest
import sglang as sgl

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import Span, marked_prompt, pdep, span
from sglang_pic.frontend_lang.engine_backend import EngineBackend

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
    "In the morning we walked to the market and bought fresh bread and apples.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # Anchored spans without recomputed heads: each span is reused whole (heads: test_span_policy.py).
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, span_head_tokens=0) as e:
        yield e


def test_second_request_computes_only_its_own_tokens(engine):
    engine.flush_cache()
    first = "Read these three documents." + span(DOCS[0]) + span(DOCS[1]) + span(DOCS[2]) + "What is in them?"
    second = "A different and longer preface for the second reader." + span(DOCS[2]) + span(DOCS[0]) + span(
        DOCS[1]
    ) + pdep("Which city?")
    engine.generate(first, GREEDY)
    before = engine.get_stats()["computed_prefill_tokens"]
    out = engine.generate(second, GREEDY)
    computed = engine.get_stats()["computed_prefill_tokens"] - before
    span_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in DOCS)
    meta = out["meta_info"]
    assert meta["cached_span_tokens"] == span_tokens  # every span reused at its new offset
    own = meta["prompt_tokens"] - span_tokens - meta["cached_prefix_tokens"]
    assert computed == own  # the prefix and question of the second request, nothing more
    assert engine.get_stats()["span_hit_rate"] > 0


def test_disable_pic_serves_plain_prefix_caching(tiny_llama):
    text = "Preface." + span(DOCS[0]) + "Question?"
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, disable_pic=True) as plain:
        assert plain.server_args.schedule_policy == "fcfs"
        out = plain.generate(text, GREEDY)
        assert out["meta_info"]["cached_span_tokens"] == 0
        flat = []
        for part in ("Preface.", DOCS[0], "Question?"):
            flat += plain.tokenizer.encode(part, add_special_tokens=part == "Preface.")
        again = plain.generate(input_ids=flat, sampling_params=GREEDY)
        assert again["output_ids"] == out["output_ids"]
        assert again["meta_info"]["cached_tokens"] == len(flat) - 1  # plain prefix hit on the same tokens


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(prompt="Preface.<|ssep|><|pdep|>Question?"), "empty span"),
        (dict(prompt="<|ssep|>"), "empty span"),
        (dict(input_ids=[5, 6, -1, 7, 100000]), "outside the vocabulary"),
        (dict(input_ids=[5, -1, -2, 7]), "empty span"),
    ],
)
def test_bad_markers_are_rejected(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(sampling_params=GREEDY, **kwargs)
    assert engine.generate("still serving", GREEDY)["meta_info"]["completion_tokens"] == 6


def test_marker_helpers_reject_markers_in_text():
    with pytest.raises(ValueError, match="marker"):
        span("a <|pdep|> b")
    with pytest.raises(ValueError, match="empty"):
        span("")
    assert marked_prompt("P", Span("doc"), "Q") == "P<|ssep|>doc<|pdep|>Q"


def test_input_ids_markers_equal_text_markers(engine):
    text = "Preface." + span(DOCS[0]) + "Question?"
    ids = (
        engine.tokenizer.encode("Preface.")
        + [-1]
        + engine.tokenizer.encode(DOCS[0], add_special_tokens=False)
        + [-2]
        + engine.tokenizer.encode("Question?", add_special_tokens=False)
    )
    assert engine.generate(text, GREEDY)["output_ids"] == engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]


@sgl.function
def rag(s, docs, question):
    s += sgl.system("You answer questions about documents.")
    s += sgl.user("".join(span(d) for d in docs) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0, ignore_eos=True))


def test_sglang_program_with_spans_on_the_offline_engine(engine, monkeypatch):
    engine.flush_cache()
    bodies = []
    serve = engine.generate_request
    monkeypatch.setattr(engine, "generate_request", lambda body: bodies.append(body) or serve(body))
    backend = EngineBackend(engine)
    first = rag.run(docs=DOCS, question="Where is Paris?", backend=backend)
    assert first["answer"] is not None
    second = rag.run(docs=DOCS[::-1], question="Where is Paris?", backend=backend)
    meta = second.get_meta_info("answer")
    assert meta["cached_span_tokens"] == sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in DOCS)
    # The program sent a marked prompt; the engine gives the same answer for that prompt directly.
    prompt = bodies[-1]["text"]
    assert prompt.count("<|ssep|>") == 3
    direct = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    assert direct["text"] == second["answer"]
