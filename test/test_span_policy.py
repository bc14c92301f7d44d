"""Anchored span prefill and recomputed span heads (span_policy.py) against a dense masked reference.

The reference runs the HF model on one flat sequence per request with an explicit 4D mask and explicit positions.
For every span it holds a hidden copy of what the span job computed: the anchor at the positions right before the
span, then the span's head as the job saw it. The span's tail attends to that copy and to itself; the request's
recomputed head, its prefix and PDEP text attend to every visible token before them, never to a hidden one. So
the reference states the semantics (anchor, heads attending to everything before them, tails to their own span
and anchor) without touching the engine's attention, slots or radix tree.
"""

from __future__ import annotations

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import pdep, span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.radix_ext.radix_tree import RadixKey
from sglang_pic.radix_ext.segments import SPAN_NAMESPACE, Segment, canonicalize, segment_keys
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_adapter.layout import SpanLayout, segments_layout
from sglang_pic.span_policy import SpanPolicy

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
    "In the morning we walked to the market and bought fresh bread and apples.",
]
NEW = 6
PARAMS = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
POLICIES = {  # name -> (span_anchor, span_head_tokens, span_tail_tokens)
    "anchor": ("auto", 0, 0),
    "head": ("none", 3, 0),
    "anchor+head": ("auto", 3, 0),
    "isolated": ("none", 0, 0),
    "anchor+seams": ("auto", 2, 2),
    "tail": ("none", 0, 3),
}


def settings(anchor: str | None, head: int | None, tail: int | None = None) -> dict:
    return {"span_anchor": anchor, "span_head_tokens": head, "span_tail_tokens": tail}


@pytest.fixture(scope="module")
def setup(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    engine = Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    yield engine, model
    engine.shutdown()


def layout(engine: Engine, text: str, given: dict) -> SpanLayout:
    """The reference's flat sequence for a prompt (segments_layout of the request the engine makes of it)."""
    return segments_layout(engine.make_reqs(GenerateReqInput(text=text, **given))[0].segments)


def reference(model, layout: SpanLayout, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and log-probabilities of the HF model run on the layout (a copy grows with the output)."""
    flat = SpanLayout(list(layout.ids), list(layout.positions), list(layout.scope), list(layout.visible))
    out, logps = [], []
    for _ in range(n):
        with torch.no_grad():
            logits = model(
                torch.tensor([flat.ids]), attention_mask=flat.mask()[None, None],
                position_ids=torch.tensor([flat.positions]),
            ).logits[0, -1].float()
        tok = int(logits.argmax())
        logps.append(torch.log_softmax(logits, -1))
        out.append(tok)
        flat.append_output([tok])
    return out, logps


def assert_answers_as(out: dict, ref_tokens: list[int], ref_logps: list[torch.Tensor]) -> None:
    """An engine output has the reference's greedy tokens and, within float32 noise, their log-probabilities."""
    assert out["output_ids"] == ref_tokens
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = torch.stack([lp[t] for lp, t in zip(ref_logps, ref_tokens)])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def cold_then_warm(engine: Engine, texts: list[str], given: dict, check) -> tuple[list[dict], list[dict]]:
    """The prompts cold one by one from an empty cache, then warm in one batch (spans reused at new offsets behind
    new prefixes, prefills beside decodes); `check(outs)` checks each run's outputs."""
    engine.flush_cache()
    cold = [engine.generate(t, PARAMS, return_logprob=True, **given) for t in texts]
    check(cold)
    warm = engine.generate(texts, PARAMS, return_logprob=True, **given)
    check(warm)
    return cold, warm


def check(engine: Engine, model, texts: list[str], outs: list[dict], given: dict) -> None:
    for text, out in zip(texts, outs):
        assert_answers_as(out, *reference(model, layout(engine, text, given), NEW))


def prompts() -> list[str]:
    """The same spans at different offsets, behind different prefixes, in different orders; one prompt ends in a
    span (its last token is the request's own) and one starts with a span."""
    return [
        "Answer the question." + span(DOCS[0]) + span(DOCS[1]) + "Where is Paris?",
        "You are a helpful assistant. Read carefully:" + span(DOCS[1]) + span(DOCS[2]) + span(DOCS[0]) + pdep("Why?"),
        span(DOCS[2]) + "What did we buy?",
        "Summarize." + span(DOCS[0]),
    ]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_cold_then_cached_equal_dense_reference(setup, policy):
    engine, model = setup
    given, texts = settings(*POLICIES[policy]), prompts()
    cold, warm = cold_then_warm(engine, texts, given, lambda outs: check(engine, model, texts, outs, given))
    assert all(o["meta_info"]["cached_span_tokens"] > 0 for o in warm)
    if given["span_head_tokens"] or given["span_tail_tokens"]:
        assert all(o["meta_info"]["recomputed_span_tokens"] > 0 for o in cold[:3])


SELECTIONS = {  # runs of a span of n tokens that each request recomputes
    "none": lambda n: (),
    "all": lambda n: ((0, n),),
    "scattered": lambda n: ((1, 2), (5, 1), (n - 3, 2)),
    "seams": lambda n: ((0, 2), (n - 2, 2)),
    "head3": lambda n: ((0, 3),),
}


@pytest.fixture
def selection(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every request's spans recompute the runs SELECTIONS[name] picks (the settings still need a head of 1 or
    more, so that spans come from jobs)."""
    runs = SELECTIONS[request.param]
    monkeypatch.setattr(SpanPolicy, "recompute_runs", lambda self, n: runs(n))
    return request.param


@pytest.mark.parametrize("selection", list(SELECTIONS), indirect=True)
def test_recomputed_selections_equal_dense_reference(setup, selection):
    """A request's row mixes its own and shared slots inside a span: cold, then warm in one batch at new offsets."""
    engine, model = setup
    given, texts = settings("auto", 1), prompts()
    _, warm = cold_then_warm(engine, texts, given, lambda outs: check(engine, model, texts, outs, given))
    if selection != "all":
        assert all(o["meta_info"]["cached_span_tokens"] > 0 for o in warm)


def test_heads_covering_the_span_equal_pdep_text(setup):
    engine, _ = setup
    engine.flush_cache()
    as_span = "Read:" + span(DOCS[0]) + "Where is Paris?"
    as_pdep = "Read:" + pdep(DOCS[0]) + pdep("Where is Paris?")
    got = engine.generate(as_span, PARAMS, return_logprob=True, span_anchor="auto", span_head_tokens=1000)
    want = engine.generate(as_pdep, PARAMS, return_logprob=True, span_anchor="none", span_head_tokens=0)
    assert got["output_ids"] == want["output_ids"]
    assert [t[0] for t in got["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in want["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert got["meta_info"]["cached_span_tokens"] == 0


def _span_length(engine: Engine, text: str) -> int:
    seg = engine.make_reqs(GenerateReqInput(text=span(text), span_anchor="none", span_head_tokens=0))[0]
    return next(len(s.tokens) for s in seg.segments if s.kind == "span")


def test_counters_say_what_each_request_computed(setup):
    """recomputed_span_tokens counts every span token a request computes itself, a span its head covers too;
    head tokens found in the cache under the same text before them are prefix hits (cached_prefix_tokens)."""
    engine, _ = setup
    engine.flush_cache()
    short = "Yes, twice."
    head = _span_length(engine, short)  # covers the short span whole: it is recomputed as PDEP text
    assert _span_length(engine, DOCS[0]) > head
    meta = [
        engine.generate(text, PARAMS, span_anchor="auto", span_head_tokens=head)["meta_info"]
        for text in ("Read:" + span(DOCS[0]) + span(short) + "Why?", "Read:" + span(DOCS[0]) + span(short) + "How?",
                     "Read:" + span(short) + span(DOCS[0]) + "Why?")
    ]
    cold, same_order, reordered = meta
    assert cold["recomputed_span_tokens"] == 2 * head and cold["cached_prefix_tokens"] == 0
    assert same_order["recomputed_span_tokens"] == 0
    assert same_order["cached_prefix_tokens"] >= 2 * head
    assert reordered["recomputed_span_tokens"] == 2 * head
    assert same_order["cached_span_tokens"] == reordered["cached_span_tokens"] == _span_length(engine, DOCS[0]) - head


def _span_slots(engine: Engine, text: str, anchor: str) -> torch.Tensor:
    """The tree's slots of a whole span (its anchor's too) under the anchor `anchor` names."""
    seg = engine.make_reqs(
        GenerateReqInput(text=span(text), span_anchor=anchor, span_head_tokens=0))[0]
    namespace, tokens = next(s for s in seg.segments if s.kind == "span").span_id
    return engine.scheduler.tree.match_prefix(RadixKey(tokens, namespace)).device_indices


def span_kv(engine: Engine, text: str) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The slots of an anchored span in the tree and a copy of their keys and values in every layer."""
    slots = _span_slots(engine, text, "auto")
    pool = engine.scheduler.runner.token_to_kv_pool
    return slots, [tuple(t[slots].clone() for t in pool.get_kv_buffer(i)) for i in range(pool.layer_num)]


def assert_span_kv_unchanged(engine: Engine, text: str, before) -> None:
    slots, kv = span_kv(engine, text)
    assert torch.equal(slots, before[0])
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, before[1]))


@pytest.mark.parametrize("selection", ["head3", "scattered"], indirect=True)
def test_shared_span_slots_never_change(setup, selection):
    engine, _ = setup
    engine.flush_cache()
    engine.generate("Cold." + span(DOCS[1]) + "Go.", PARAMS, span_anchor="auto", span_head_tokens=3)
    before = span_kv(engine, DOCS[1])
    texts = [f"Prefix number {i} is different." + span(DOCS[1]) + "Go." for i in range(4)]
    outs = engine.generate(texts, PARAMS, span_anchor="auto", span_head_tokens=3)
    recomputed = sum(n for _, n in SELECTIONS[selection](_span_length(engine, DOCS[1])))
    assert all(o["meta_info"]["recomputed_span_tokens"] == recomputed for o in outs)
    assert_span_kv_unchanged(engine, DOCS[1], before)


def _assert_accounting(engine: Engine) -> None:
    sched = engine.scheduler
    assert sched.is_idle()
    alloc, tree = sched.runner.allocator, sched.tree
    assert tree.protected_size() == 0
    assert alloc.available_size() + tree.total_size() == alloc.size


@pytest.mark.parametrize("selection", ["head3", "scattered"], indirect=True)
def test_accounting_after_finish_and_abort(setup, selection):
    engine, _ = setup
    engine.flush_cache()
    texts = [f"Request {i} asks." + span(DOCS[i % 3]) + span(DOCS[(i + 1) % 3]) + "Answer:" for i in range(6)]
    engine.generate(texts, PARAMS, span_anchor="auto", span_head_tokens=3)
    _assert_accounting(engine)
    rid = "abort-me"
    with engine._lock:
        for req in engine.make_reqs(GenerateReqInput(
                text="Abort." + span(DOCS[2]) + "x", sampling_params={"max_new_tokens": 64}, rid=rid,
                span_anchor="auto", span_head_tokens=3)):
            engine.scheduler.add_request(req)
        engine.scheduler.step()
        engine.scheduler.step()
        assert engine.scheduler.abort_request(rid) is not None
    while not engine.scheduler.is_idle():
        engine.scheduler.step()
    _assert_accounting(engine)


@pytest.mark.parametrize("selection", ["head3", "scattered"], indirect=True)
def test_accounting_after_retraction(tiny_llama, selection):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=420, max_running_requests=16,
                span_head_tokens=3, chunked_prefill_size=64) as engine:
        texts = [f"Q{i}." + span(DOCS[i % 3]) + "Answer at length:" for i in range(12)]
        outs = engine.generate(texts, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert engine.scheduler.stats.num_retractions > 0
        _assert_accounting(engine)


def test_anchor_is_part_of_the_span_key():
    span_seg = Segment("span", (5, 6, 7))
    anchored = Segment("span", (5, 6, 7), anchor=(1, 2))
    other = Segment("span", (5, 6, 7), anchor=(1, 3))
    keys = [segment_keys(canonicalize([Segment("prefix", (9,)), s, Segment("pdep", (4,))]))
            for s in (span_seg, anchored, other)]
    assert keys[0][1] == RadixKey((5, 6, 7), SPAN_NAMESPACE)
    # an anchored span is the plain text anchor + span: never a hit across anchors, nor with an isolated span
    assert keys[1][1] == RadixKey((1, 2, 5, 6, 7), None) and keys[2][1] == RadixKey((1, 3, 5, 6, 7), None)
    assert len({k[2].extra_key for k in keys}) == 3  # and the PDEP text after each depends on it
    with_head = segment_keys(canonicalize([Segment("prefix", (9,)), Segment("span", (5, 6, 7), recompute=((0, 1),)),
                                           Segment("pdep", (4,))]))
    assert with_head[1] == keys[0][1] and with_head[2].extra_key != keys[0][2].extra_key


def test_anchors_never_cross_hit(setup):
    engine, _ = setup
    engine.flush_cache()
    text = "Read." + span(DOCS[0]) + "Where?"
    def cached(anchor: str) -> int:
        out = engine.generate(text, PARAMS, span_anchor=anchor, span_head_tokens=0)
        return out["meta_info"]["cached_span_tokens"]

    cached("auto")
    assert cached("none") == 0
    assert cached("none") > 0 and cached("auto") > 0


def test_bad_settings_are_refused(setup, tiny_llama):
    engine, _ = setup
    for fields, named in (({"span_head_tokens": -1}, "span_head_tokens"), ({"span_head_tokens": "4"},
                          "span_head_tokens"), ({"span_anchor": "bos"}, "span_anchor")):
        with pytest.raises(ValueError, match=named):
            engine.generate("x" + span(DOCS[0]), PARAMS, **fields)
    with pytest.raises(ValueError, match="prompt logprobs"):
        engine.generate("x" + span(DOCS[0]) + "y", PARAMS, return_logprob=True, logprob_start_len=0,
                        span_anchor="auto", span_head_tokens=0)
    (req,) = engine.make_reqs(
        GenerateReqInput(text="x" + span(DOCS[0]) + "y", span_head_tokens=3))
    span_end = next(s.start + len(s.tokens) for s in req.segments if s.kind == "span")
    with pytest.raises(ValueError, match="prompt logprobs"):  # the span's last token scores the next one
        engine.generate("x" + span(DOCS[0]) + "y", PARAMS, return_logprob=True, logprob_start_len=span_end,
                        span_head_tokens=3)
    after = engine.generate("x" + span(DOCS[0]) + "y", PARAMS, return_logprob=True,
                            logprob_start_len=span_end + 1, span_head_tokens=3)
    assert after["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match="page_size 1"):
        ServerArgs(model_path=str(tiny_llama), page_size=4, span_head_tokens=4)
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=1024, page_size=4) as paged:
        assert not paged.request_builder.span_policy.from_job  # auto turns into isolated spans here
        with pytest.raises(ValueError, match="page_size 1"):
            paged.generate("x" + span(DOCS[0]), PARAMS, span_head_tokens=2)


def test_per_span_settings_equal_dense_reference(setup):
    """Spans carrying their own settings (span(doc, anchor=..., head_tokens=...)) over the request's, among spans
    that follow the request's, cold and cached."""
    engine, model = setup
    engine.flush_cache()
    texts = [
        "Answer the question." + span(DOCS[0], anchor="none", head_tokens=0) + span(DOCS[1]) + "Where is Paris?",
        "Read carefully:" + span(DOCS[1], head_tokens=1) + span(DOCS[2], anchor="prefix") + pdep("Why?"),
        "Read carefully:" + span(DOCS[2], anchor="prefix", head_tokens=2) + span(DOCS[0], anchor="none") + "What?",
        "Seams." + span(DOCS[1], head_tokens=0, tail_tokens=2) + span(DOCS[0], tail_tokens=1) + "Which?",
        "Chosen." + span(DOCS[2], recompute=[(3, 2), (7, 1)]) + span(DOCS[1], recompute=[]) + "Who?",
    ]
    for _ in range(2):
        outs = engine.generate(texts, PARAMS, return_logprob=True, span_anchor="auto", span_head_tokens=3)
        check(engine, model, texts, outs, settings("auto", 3))
    assert all(o["meta_info"]["cached_span_tokens"] > 0 for o in outs)
    (req,) = engine.make_reqs(
        GenerateReqInput(text=texts[1], span_anchor="auto", span_head_tokens=3))
    tails = [s for s in req.segments if s.kind == "span"]
    anchor = engine.request_builder.span_policy.anchor
    prefix = tuple(req.segments[0].tokens)
    assert [s.extra_key for s in tails] == [None, None]
    assert tails[0].key_lead[: len(anchor)] == anchor and len(tails[0].key_lead) == len(anchor) + 1
    # behind the prompt's own prefix, with the request's 3 head tokens
    assert tails[1].key_lead[: len(prefix)] == prefix and len(tails[1].key_lead) == len(prefix) + 3


def test_prefix_anchor_reads_a_plain_prompts_kv(setup):
    """A span anchored on its prompt's prefix is the plain text prefix + span: a plain prompt computed it."""
    engine, model = setup
    engine.flush_cache()
    text = "Context follows." + span(DOCS[0], anchor="prefix", head_tokens=0) + "Where is Paris?"
    (req,) = engine.make_reqs(GenerateReqInput(text=text))
    prefix, tail = req.segments[0], req.segments[1]
    engine.generate(input_ids=prefix.tokens + tail.tokens, sampling_params={"max_new_tokens": 0})
    out = engine.generate(text, PARAMS, return_logprob=True)
    assert out["meta_info"]["cached_span_tokens"] == len(tail.tokens)
    check(engine, model, [text], [out], settings(None, None))


@pytest.mark.parametrize("own, named", [
    ('{"span_head_tokens": -1}', "span 0: span_head_tokens must be"),
    ('{"span_anchor": "bos"}', "span 0: span_anchor must be one of"),
    ('{"head": 2}', "unknown span setting 'head'"),
    ('{"span_recompute": [[0, -1]]}', "span 0: span_recompute must be a list of"),
    ('{"span_recompute": 3}', "span 0: span_recompute must be a list of"),
    ('{"span_tail_tokens": "2"}', "span 0: span_tail_tokens must be"),
    ('{"span_head_tokens": 2', "not JSON"),
    ('[2]', "must be a JSON object"),
])
def test_bad_span_settings_are_refused(setup, own, named):
    engine, _ = setup
    with pytest.raises(ValueError, match=named):
        engine.generate("x" + "<|ssep|><|span_settings|>" + own + DOCS[0] + "<|pdep|>y", PARAMS)


def test_span_settings_marker_only_follows_a_span_marker(setup):
    engine, _ = setup
    with pytest.raises(ValueError, match="must follow a span marker"):
        engine.generate('x<|span_settings|>{"span_head_tokens": 0}' + span(DOCS[0]), PARAMS)
    for bad in ({"anchor": "bos"}, {"head_tokens": -1}, {"head_tokens": True}):
        with pytest.raises(ValueError):
            span(DOCS[0], **bad)
