"""Query-driven selection (span_query_share, managers/span_probe.py) against a reference probe and the dense
masked reference of test_span_policy.

The reference probe runs the HF model (eager attention, which returns its probabilities) on the probe pass's flat
sequence: the prompt as the request's other settings lay it out, each span's hidden anchor and head as its job saw
them. It sums the question's attention to every visible position over layers, heads and question tokens, and
takes the share of the span tokens no seam covers in blocks, the highest summed blocks first. The engine must
choose exactly those tokens, and its answer must then equal the dense reference of the prompt with them
recomputed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from probe_choices import recording
from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers import span_probe
from sglang_pic.managers.io_struct import GenerateReqInput, wire_segments
from sglang_pic.managers.req import ReqSegment
from sglang_pic.server_args import ServerArgs
from test_span_policy import (
    DOCS, NEW, PARAMS, _assert_accounting, assert_answers_as, assert_span_kv_unchanged, cold_then_warm,
    prompts, reference, segments_layout, span_kv,
)

SHARE = 0.3
GIVEN = {"span_anchor": "auto", "span_head_tokens": 1, "span_query_share": SHARE}


@pytest.fixture(scope="module")
def setup(tiny_llama):
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation=impl).eval()
              for impl in ("sdpa", "eager")]  # eager returns its probabilities
    engine = Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    yield engine, models
    engine.shutdown()


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every choice the engine's probes make, in order: the re-keyed canonical prompts."""
    made: list = []
    monkeypatch.setattr(span_probe, "choose", recording(made))
    return made


def choices_of(chosen: list, req) -> list:
    """The choices made for the prompt of `req`."""
    return [c for c in chosen if [t for seg in c for t in seg.token_ids] == req.prompt_ids()]


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the additive one eager attention expects."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def reference_choice(model, req) -> set[int]:
    """The prompt positions the reference probe recomputes (see the module doc)."""
    flat = segments_layout(req.segments)
    ids, pos, visible, mask = flat.ids, flat.positions, flat.visible, flat.mask()
    with torch.no_grad():
        out = model(torch.tensor([ids]), attention_mask=additive(mask)[None, None], position_ids=torch.tensor([pos]),
                    output_attentions=True)
    rows = [i for i, p in enumerate(pos) if visible[i] and p >= req.question_start]
    mass = sum(a[0][:, rows].sum(dim=(0, 1)) for a in out.attentions)
    return chosen_blocks(req, {p: float(mass[i]) for i, p in enumerate(pos) if visible[i]})


def chosen_blocks(req, by_position: dict[int, float], select: str = "query") -> set[int]:
    """The positions a request with these scores recomputes: of its spans that `select` scores, the share of their
    tokens that no seam covers, in aligned blocks, the highest summed blocks first (the earlier on ties)."""
    blocks = []  # (minus the block's summed score, its first position, its positions)
    at, budget = 0, 0.0
    for seg in req.probe:
        if seg.kind == "span" and seg.query_share > 0 and seg.select == select:
            covered = {o + i for o, n in seg.recompute for i in range(n)}
            for lo in range(0, len(seg.token_ids), span_probe.SELECT_BLOCK):
                free = [at + o for o in range(lo, min(lo + span_probe.SELECT_BLOCK, len(seg.token_ids)))
                        if o not in covered]
                if free:
                    blocks.append((-sum(by_position[p] for p in free), free[0], free))
            budget += seg.query_share * len(seg.token_ids)
        at += len(seg.token_ids)
    chosen: list[int] = []
    for _, _, free in sorted(blocks, key=lambda b: b[:2]):
        chosen += free[: round(budget) - len(chosen)]
    return set(chosen)


def span_positions(segments: list[ReqSegment]) -> set[int]:
    """Prompt positions of span text the request computes itself (recomputed runs, spans turned into text)."""
    return {seg.start + o + i for seg in segments for o, n in seg.span_runs for i in range(n)}


def probe_pass(engine: Engine, text: str):
    """The request in its probe-pass form (its segments before the probe chooses)."""
    return engine.make_reqs(GenerateReqInput(text=text, **GIVEN))[0]


def check_against_reference(engine, model, choice, texts, outs, chosen, given=GIVEN) -> None:
    """Each request chose what `choice(req)` (a reference selection) chooses for it, and answered as the dense
    reference of its prompt with those tokens recomputed."""
    for text, out in zip(texts, outs):
        req = engine.make_reqs(GenerateReqInput(text=text, **given))[0]
        (segments,) = choices_of(chosen, req)
        final = [ReqSegment.from_wire(s) for s in wire_segments(segments)]
        assert span_positions(final) - span_positions(req.segments) == choice(req)
        assert_answers_as(out, *reference(model, segments_layout(final), NEW))


def test_probe_chooses_what_the_reference_probe_chooses_and_answers_as_dense(setup, chosen):
    """Cold one by one, then warm in one batch with the spans at different offsets."""
    engine, (model, eager) = setup
    check_cold_and_warm(engine, model, lambda req: reference_choice(eager, req), chosen, GIVEN)


def check_cold_and_warm(engine, model, choice, chosen, given) -> None:
    """check_against_reference cold one by one, then warm in one batch with the spans at different offsets."""
    texts = prompts()

    def check(outs: list[dict]) -> None:
        check_against_reference(engine, model, choice, texts, outs, chosen, given)
        chosen.clear()  # the next run's requests choose again

    _, warm = cold_then_warm(engine, texts, given, check)
    assert all(o["meta_info"]["cached_span_tokens"] > 0 for o in warm)


def test_the_same_request_chooses_the_same_tokens(setup, chosen):
    assert_same_choice(setup[0], chosen, GIVEN)


def assert_same_choice(engine, chosen, given) -> None:
    """A prompt alone twice and in a batch with another chooses the same tokens each time and answers alike."""
    engine.flush_cache()
    text = prompts()[1]
    outs = [engine.generate(text, PARAMS, **given) for _ in range(2)]
    outs.append(engine.generate([text, prompts()[0]], PARAMS, **given)[0])
    choices = choices_of(chosen, engine.make_reqs(GenerateReqInput(text=text, **given))[0])
    assert len(choices) == 3 and choices[0] == choices[1] == choices[2]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == outs[2]["output_ids"]


def test_counts_cover_both_passes(setup, chosen):
    """recomputed_span_tokens: the heads and the chosen tokens, each once (the probe pass computed the heads, the
    second prefill found the first one in the cache); the cache counts are what the cache held before the probe
    pass; probe_tokens, what the second prefill computed."""
    engine, _ = setup
    engine.flush_cache()
    text = "Read this:" + span(DOCS[0]) + span(DOCS[1]) + "Which city?"
    engine.generate("Warm the spans." + span(DOCS[0]) + span(DOCS[1]) + "Go.", PARAMS, span_anchor="auto",
                    span_head_tokens=1)
    meta = engine.generate(text, PARAMS, **GIVEN)["meta_info"]
    req = probe_pass(engine, text)
    span_tokens = sum(len(s.token_ids) for s in req.probe if s.kind == "span")
    picked = round(SHARE * span_tokens)
    assert meta["recomputed_span_tokens"] == 2 + picked
    assert meta["cached_span_tokens"] == span_tokens - 2
    (segments,) = choices_of(chosen, req)
    final = [ReqSegment.from_wire(s) for s in wire_segments(segments)]
    first_chosen = min(span_positions(final) - span_positions(req.segments))
    own_after = sum(1 for seg in final if seg.kind != "span" for i in range(len(seg.tokens))
                    if seg.start + i >= first_chosen)  # shared span KV is read, everything else computed again
    assert meta["probe_tokens"] == own_after


SELECTORS = ["query", "deviation"]  # the deviation pass (test_span_deviation.py) shares these tests


@pytest.mark.parametrize("select", SELECTORS)
def test_shared_span_slots_never_change(setup, select):
    engine, _ = setup
    engine.flush_cache()
    engine.generate("Cold." + span(DOCS[1]) + "Go.", PARAMS, span_anchor="auto", span_head_tokens=1)
    before = span_kv(engine, DOCS[1])
    outs = engine.generate([f"Prefix number {i} differs." + span(DOCS[1]) + f"Question {i}?" for i in range(4)],
                           PARAMS, **GIVEN, span_select=select)
    assert all(o["meta_info"]["probe_tokens"] > 0 for o in outs)
    assert_span_kv_unchanged(engine, DOCS[1], before)


@pytest.mark.parametrize("select", SELECTORS)
def test_accounting_after_finish_abort_and_retraction(setup, tiny_llama, select):
    """Slots, tree locks and table rows (a deviation pass's scratch row too) are all free again."""
    engine, _ = setup
    given = {**GIVEN, "span_select": select}
    rows = engine.scheduler.runner.req_to_token_pool
    free_rows = rows.available_size()
    engine.flush_cache()
    engine.generate([f"Request {i}." + span(DOCS[i % 3]) + span(DOCS[(i + 1) % 3]) + "Answer:" for i in range(6)],
                    PARAMS, **given)
    _assert_accounting(engine)
    for steps in range(4):  # aborted before, during and after its probe pass
        rid = f"abort-{steps}"
        with engine._lock:
            for req in engine.make_reqs(GenerateReqInput(text=f"Abort {steps}." + span(DOCS[2]) + "x", rid=rid,
                                                         sampling_params={"max_new_tokens": 64}, **given)):
                engine.scheduler.add_request(req)
            for _ in range(steps):
                engine.scheduler.step()
            assert engine.scheduler.abort_request(rid) is not None
        while not engine.scheduler.is_idle():
            engine.scheduler.step()
        _assert_accounting(engine)
    assert rows.available_size() == free_rows
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=420, max_running_requests=16,
                span_head_tokens=1, span_query_share=SHARE, span_select=select, chunked_prefill_size=64) as small:
        outs = small.generate([f"Q{i}." + span(DOCS[i % 3]) + "Answer at length:" for i in range(12)],
                              {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert small.scheduler.stats.num_retractions > 0
        _assert_accounting(small)


def test_a_probe_batch_never_replays_a_cuda_graph():
    """Its layers score the question in Python, which a graph replay would skip: a one-request extend that fits a
    captured size replays, the same batch with a probe does not."""
    from types import SimpleNamespace

    from sglang_pic.forward_batch import ForwardMode
    from sglang_pic.layers.attention_probe import AttentionProbe
    from sglang_pic.model_executor.cuda_graph_runner import CudaGraphRunner

    runner = object.__new__(CudaGraphRunner)
    runner.batch_sizes, runner.extend_sizes, runner.shared_plan = [4], [8], None
    runner.adapter_variants = (False,)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1, num_decode_tail=0,
                            input_ids=torch.zeros(5), shared_decode=None, probe=None, span_scaling=None,
                            deviation=None, span_adapter_rows_cpu=[0] * 5)
    assert runner.can_run(batch)
    batch.probe = AttentionProbe()
    assert not runner.can_run(batch)
    # Nor does a batch with APE's span scaling: its two kernel passes loop over ranges no graph was captured with.
    batch.probe, batch.span_scaling = None, object()
    assert not runner.can_run(batch)
    batch.span_scaling, batch.deviation = None, object()  # nor a deviation pass, which stops after its first layers
    assert not runner.can_run(batch)


def test_choose_takes_the_best_blocks_of_uncovered_span_tokens(monkeypatch):
    from sglang_pic.radix_ext.segments import Segment

    monkeypatch.setattr(span_probe, "SELECT_BLOCK", 4)
    segments = (Segment("prefix", (1, 2)), Segment("span", tuple(range(10, 22)), recompute=((0, 2),), query_share=0.4),
                Segment("pdep", (3,)), Segment("span", tuple(range(30, 42)), query_share=0.0), Segment("pdep", (4,)))
    scores = np.zeros(28)
    # span 1 sits at 2..13 in blocks 2-5 (2 and 3 covered: 2 left), 6-9 (summing 6), 10-13 (3); span 2 has no share
    scores[[2, 3, 4, 5, 6, 9, 10, 11, 18]] = [50, 50, 1, 1, 3, 3, 2, 1, 99]
    out = span_probe.choose(segments, scores, "query")
    assert out[1].recompute == ((0, 2), (4, 5))  # round(0.4 x 12) = 5 tokens: offsets 4-7, then 8 of the next block
    assert out[3].recompute == ()
    assert span_probe.choose(segments, scores, "deviation") == list(segments)  # no span selects by deviation


def test_per_span_shares_choose_in_their_spans_only(setup, chosen):
    """A span's own query_share over the request's: a span with share 0 keeps its shared KV whole."""
    engine, models = setup
    engine.flush_cache()
    text = "Read:" + span(DOCS[0], query_share=0.0) + span(DOCS[1], query_share=0.5) + "Which one?"
    out = engine.generate(text, PARAMS, return_logprob=True, span_anchor="auto", span_head_tokens=1)
    req = engine.make_reqs(GenerateReqInput(text=text, span_anchor="auto", span_head_tokens=1))[0]
    (segments,) = choices_of(chosen, req)
    first, second = (s for s in segments if s.kind == "span")
    assert first.recompute == ((0, 1),)
    assert sum(n for _, n in second.recompute) == 1 + round(0.5 * len(second.token_ids))
    final = [ReqSegment.from_wire(s) for s in wire_segments(segments)]
    assert out["output_ids"] == reference(models[0], segments_layout(final), NEW)[0]


@pytest.mark.parametrize("value", [1.5, -0.1, "0.2", True])
def test_bad_query_shares_are_refused(setup, value):
    engine, _ = setup
    with pytest.raises(ValueError, match="span_query_share must be a number in"):
        engine.generate("x" + span(DOCS[0]) + "y", PARAMS, span_query_share=value)
    with pytest.raises(ValueError, match="span 0: span_query_share must be a number in"):
        engine.generate("x" + f'<|ssep|><|span_settings|>{{"span_query_share": {json.dumps(value)}}}' + DOCS[0]
                        + "<|pdep|>y", PARAMS)


def test_servers_that_cannot_probe_refuse_it(tiny_llama):
    for flags, named in (({"page_size": 4}, "page_size 1"), ({"disable_radix_cache": True}, "radix cache")):
        with pytest.raises(ValueError, match=named):
            ServerArgs(model_path=str(tiny_llama), span_query_share=0.2, **flags)
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=1024, page_size=4) as paged:
        with pytest.raises(ValueError, match="span_query_share need a server with the radix cache and page_size 1"):
            paged.generate("x" + span(DOCS[0]) + "y", PARAMS, span_query_share=0.2)
