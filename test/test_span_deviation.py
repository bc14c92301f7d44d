"""Deviation-selected recompute (span_select deviation, managers/span_deviation.py) against a reference selection
and the dense masked reference of test_span_policy.

The reference runs the HF model twice per request: once on the whole prompt with full attention, once per span on
what its job computes (the anchor, then the span). At the deviation layer it projects each run's hidden states to
keys and values and scores every span position the request reads from the shared copy by the squared distance of
its dense key and value from the job's, each relative to the job's squared norm, summed over kv heads. It takes
the share in blocks as a query probe does (test_span_probe.chosen_blocks). The engine must choose exactly those
tokens, and then answer as the dense reference of the prompt with them recomputed.
"""

from __future__ import annotations

import json

import pytest
import torch

from probe_choices import recording
from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers import span_probe
from sglang_pic.managers.io_struct import GenerateReqInput, wire_segments
from sglang_pic.managers.req import ReqSegment
from sglang_pic.managers.span_deviation import DEVIATION_LAYERS
from test_span_policy import DOCS, NEW, PARAMS, assert_answers_as, prompts, reference, segments_layout
from test_span_probe import SHARE, assert_same_choice, check_cold_and_warm, chosen_blocks

GIVEN = {"span_anchor": "auto", "span_head_tokens": 1, "span_query_share": SHARE, "span_select": "deviation"}


@pytest.fixture(scope="module")
def setup(tiny_llama):
    from transformers import AutoModelForCausalLM

    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096) as engine:
        yield engine, AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> list:
    made: list = []
    monkeypatch.setattr(span_probe, "choose", recording(made))
    return made


def layer_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [len, Hkv, D] of the deviation layer, unrotated, for `ids` at positions 0.. with full
    causal attention."""
    layer = model.model.layers[DEVIATION_LAYERS - 1]
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[DEVIATION_LAYERS - 1][0]
        x = layer.input_layernorm(hidden)
        shape = (len(ids), -1, layer.self_attn.head_dim)
        return layer.self_attn.k_proj(x).view(shape), layer.self_attn.v_proj(x).view(shape)


def reference_choice(model, req) -> set[int]:
    """The prompt positions the reference selection recomputes (see the module doc)."""
    dense_k, dense_v = layer_kv(model, req.prompt_ids())
    by_position: dict[int, float] = {}
    at = 0
    for seg in req.probe:
        n = len(seg.token_ids)
        if seg.kind == "span":
            lead = len(seg.anchor)
            job_k, job_v = layer_kv(model, list(seg.anchor) + list(seg.token_ids))
            for o in range(n):
                k, v = job_k[lead + o], job_v[lead + o]
                dev = ((dense_k[at + o] - k).square().sum(-1) / k.square().sum(-1)).sum()
                dev += ((dense_v[at + o] - v).square().sum(-1) / v.square().sum(-1)).sum()
                by_position[at + o] = float(dev)
        at += n
    return chosen_blocks(req, by_position, "deviation")


def selecting(engine: Engine, text: str):
    """The request before it selects (its probe form)."""
    return engine.make_reqs(GenerateReqInput(text=text, **GIVEN))[0]


def test_deviation_chooses_what_the_reference_chooses_and_answers_as_dense(setup, chosen):
    engine, model = setup
    check_cold_and_warm(engine, model, lambda req: reference_choice(model, req), chosen, GIVEN)


def test_the_same_request_chooses_the_same_tokens(setup, chosen):
    assert_same_choice(setup[0], chosen, GIVEN)


def test_counts(setup):
    """recomputed_span_tokens: the heads and the chosen tokens; probe_tokens: the pass, in whole-model token
    equivalents (the tiny model has as many layers as the pass)."""
    engine, _ = setup
    engine.flush_cache()
    text = "Read this:" + span(DOCS[0]) + span(DOCS[1]) + "Which city?"
    meta = engine.generate(text, PARAMS, **GIVEN)["meta_info"]
    req = selecting(engine, text)
    span_tokens = sum(len(s.token_ids) for s in req.probe if s.kind == "span")
    assert meta["recomputed_span_tokens"] == 2 + round(SHARE * span_tokens)
    layers = engine.scheduler.runner.model_config.num_hidden_layers
    assert meta["probe_tokens"] == -(-req.prompt_len * min(DEVIATION_LAYERS, layers) // layers)


def test_spans_that_select_both_ways(setup, chosen):
    """A span's own selector over the request's: the deviation pass chooses in its spans first, then the probe pass
    in the others. Each choice is the one a request with only that pass makes, and the answer is the dense
    reference's with all chosen tokens recomputed."""
    engine, model = setup
    engine.flush_cache()
    given = {**GIVEN, "span_select": "query"}
    mixed = "Read:" + span(DOCS[0], select="deviation") + span(DOCS[1]) + "Which one?"
    out = engine.generate(mixed, PARAMS, return_logprob=True, **given)
    by_deviation, by_query = chosen
    first = next(s for s in by_deviation if s.kind == "span")
    assert [s.query_share for s in by_deviation if s.kind == "span"] == [0.0, SHARE]  # the query span waits

    chosen.clear()
    engine.generate("Read:" + span(DOCS[0], select="deviation") + span(DOCS[1], query_share=0.0) + "Which one?",
                    PARAMS, **given)
    assert next(s for s in chosen[0] if s.kind == "span").recompute == first.recompute

    chosen.clear()
    runs = [list(run) for run in first.recompute]
    explicit = engine.generate("Read:" + span(DOCS[0], recompute=runs, query_share=0.0) + span(DOCS[1]) + "Which one?",
                               PARAMS, return_logprob=True, **given)
    assert chosen == [by_query]
    assert explicit["output_ids"] == out["output_ids"]
    final = [ReqSegment.from_wire(s) for s in wire_segments(by_query)]
    assert_answers_as(out, *reference(model, segments_layout(final), NEW))
    spans = [s for s in by_query if s.kind == "span"]
    assert out["meta_info"]["recomputed_span_tokens"] == sum(n for s in spans for _, n in s.recompute)
    req = selecting(engine, mixed)
    layers = engine.scheduler.runner.model_config.num_hidden_layers
    assert out["meta_info"]["probe_tokens"] > -(-req.prompt_len * min(DEVIATION_LAYERS, layers) // layers)


@pytest.mark.parametrize("value", ["prompt", "", 1])
def test_bad_selectors_are_refused(setup, value):
    """A request's selector and a span's own."""
    engine, _ = setup
    with pytest.raises(ValueError, match="span_select"):
        engine.generate(prompts()[0], PARAMS, span_select=value)
    text = "Q:" + span(DOCS[0]).replace(DOCS[0], '<|span_settings|>{"span_select": %s}' % json.dumps(value) + DOCS[0])
    with pytest.raises(ValueError, match="span 0: span_select must be one of"):
        engine.generate(text + "?", PARAMS)
