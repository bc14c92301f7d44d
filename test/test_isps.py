"""ISPS: span prefills interleaved with decodes — each span computed once, no starvation, same tokens as FCFS."""

from __future__ import annotations

from collections import Counter

import pytest

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import ReqSegment

# Isolated spans (span_policy.py): ISPS's scheduling of spans a request may compute itself. Spans from jobs
# (anchored, recomputed heads) are scheduled in test_span_policy.py and test_scheduler_liveness.py.
ISOLATED = dict(span_anchor="none", span_head_tokens=0)

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
    "In the morning we walked to the market and bought fresh bread and apples.",
    "She opened the old book and read the first chapter aloud to the children.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def workload() -> list[str]:
    out = []
    for i in range(8):
        docs = [DOCS[(i + k) % len(DOCS)] for k in range(3)]
        out.append(f"Question {i}." + "".join(span(d) for d in docs) + f"Which document mentions item {i}?")
    return out


def spy_span_computation(engine: Engine) -> Counter:
    """Count, per span, how many of its tokens get fresh KV slots (= are computed)."""
    counts: Counter = Counter()
    kv = engine.scheduler.kv
    original = kv.alloc

    def alloc(req, seg_counts):
        for seg, n in zip(req.segments, seg_counts):
            if seg.kind == "span" and n > 0:
                counts[tuple(seg.tokens)] += n
        return original(req, seg_counts)

    kv.alloc = alloc
    return counts


@pytest.mark.parametrize("page_size", [1, 4])
def test_isps_computes_each_span_once_and_matches_fcfs(tiny_llama, page_size):
    texts = workload()
    common = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, page_size=page_size)
    with Engine(**ISOLATED, schedule_policy="fcfs", **common) as fcfs:
        expected = [o["output_ids"] for o in fcfs.generate(texts, GREEDY)]
    with Engine(**ISOLATED, schedule_policy="isps", step_token_budget=64, **common) as isps:
        counts = spy_span_computation(isps)
        outs = isps.generate(texts, GREEDY)
        assert [o["output_ids"] for o in outs] == expected
        span_lens = {tuple(isps.tokenizer.encode(d, add_special_tokens=False)) for d in DOCS}
        for tokens in span_lens:
            # Whole pages of a span are computed once; only a partial last page may be recomputed per request.
            assert counts[tokens] <= len(tokens) + (len(tokens) % page_size) * len(texts)
        assert sum(o["meta_info"]["cached_span_tokens"] for o in outs) > 0


def test_isps_never_starves_a_request(tiny_llama):
    """A request whose span only it needs is served within a bounded number of steps, however many popular
    span prefills keep arriving."""
    max_wait = 6
    with Engine(**ISOLATED,
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=8192, schedule_policy="isps",
        step_token_budget=24, isps_max_wait_steps=max_wait,
    ) as engine:
        sched = engine.scheduler
        lonely = engine.make_reqs(GenerateReqInput(text="Alone." + span(DOCS[3] * 2) + "?", sampling_params=GREEDY))[0]
        sched.add_request(lonely)
        steps = 0
        while lonely.first_token_time is None:
            # Every step more popular span work arrives than the step budget holds (each span shared by two).
            for j in range(2):
                popular = f"Popular document {steps} {j} about the market and the sea and the town."
                for k in range(2):
                    text = f"Reader {k}." + span(popular) + "Summarize."
                    for req in engine.make_reqs(GenerateReqInput(text=text, sampling_params=GREEDY)):
                        sched.add_request(req)
            sched.step()
            steps += 1
            assert steps < 60, "the lonely request starved"
        # It waits at most max_wait steps before its span job runs, then a few steps to compute span and prompt.
        assert steps <= max_wait + 8


def test_warm_spans_then_prompts_reuse_them(tiny_llama):
    with Engine(
        **ISOLATED, model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, schedule_policy="fcfs"
    ) as engine:
        info = engine.warm_spans(DOCS[:2])
        assert info["computed_tokens"] == info["span_tokens"]
        again = engine.warm_spans(DOCS[:2])
        assert again["computed_tokens"] == 0
        out = engine.generate("Prefix." + span(DOCS[0]) + span(DOCS[1]) + "Question?", GREEDY)
        assert out["meta_info"]["cached_span_tokens"] == info["span_tokens"]
        with pytest.raises(ValueError, match="marker"):
            engine.warm_spans(["bad <|ssep|> span"])


def test_isps_under_memory_pressure_finishes_everything(tiny_llama):
    """A small pool forces retractions while span jobs and chunked prefills hold memory: nothing is aborted and
    the tokens equal a roomy FCFS run."""
    texts = workload() * 2
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(
        **ISOLATED, model_path=str(tiny_llama), dtype="float32", max_total_tokens=8192, schedule_policy="fcfs") as big:
        expected = [o["output_ids"] for o in big.generate(texts, params)]
    with Engine(**ISOLATED,
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=512, page_size=4, schedule_policy="isps",
        step_token_budget=48, chunked_prefill_size=48,
    ) as small:
        outs = small.generate(texts, params)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * len(texts)
        assert [o["output_ids"] for o in outs] == expected
        assert small.scheduler.stats.num_retractions > 0


def test_isps_starts_decodes_while_span_prefills_remain(tiny_llama):
    """When the span work outgrows a step's budget, the requests whose spans are done start decoding while other
    span prefills still run (no barrier), and the first request is ready well before the last span is computed."""
    docs = [f"Document {i} tells how the river town {i} traded salt, wool and {i} kinds of apples." for i in range(12)]
    texts = [f"Reader {i}." + "".join(span(docs[(3 * i + k) % 12]) for k in range(3)) + "Answer?" for i in range(8)]
    with Engine(**ISOLATED,
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=8192, schedule_policy="isps",
        step_token_budget=40, isps_max_wait_steps=1000,
    ) as engine:
        sched = engine.scheduler
        for text in texts:
            for req in engine.make_reqs(GenerateReqInput(text=text, sampling_params=GREEDY)):
                sched.add_request(req)
        overlapped, steps = 0, 0
        while not sched.is_idle():
            sched.step()
            steps += 1
            span_work_left = any(r.warmup for r in sched.waiting) or (sched.chunked is not None and sched.chunked.warmup)
            overlapped += bool(span_work_left and sched.running)
            assert steps < 500
        assert overlapped >= 3, f"decodes ran next to span prefills in only {overlapped} steps"


@pytest.mark.timeout(120)  # the bug this guards against was a request requeued forever
def test_prompt_logprobs_over_a_span_compute_it_in_the_request(tiny_llama):
    """A request returning prompt logprobs over a span needs the span's logits, so it computes the span itself and
    must not wait for its cached KV: it used to be released and requeued every step once the span was cached. Its
    logprobs are the same whether the span was cached or not; logprobs that start after the span reuse it."""
    prompt = "Preface." + span(DOCS[1]) + "Which one?"
    logprobs = dict(return_logprob=True, logprob_start_len=0)
    with Engine(**ISOLATED, model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as cold:
        want = cold.generate(prompt, GREEDY, **logprobs)["meta_info"]
    with Engine(**ISOLATED, model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as warm:
        warm.warm_spans([DOCS[1]])
        got = warm.generate(prompt, GREEDY, **logprobs)["meta_info"]
        assert got["cached_span_tokens"] == 0
        assert len(got["input_token_logprobs"]) == got["prompt_tokens"]
        assert [v for v, *_ in got["input_token_logprobs"][1:]] == pytest.approx(
            [v for v, *_ in want["input_token_logprobs"][1:]], abs=1e-5
        )
        late = warm.generate(prompt, GREEDY, return_logprob=True, logprob_start_len=got["prompt_tokens"] - 2)
        assert late["meta_info"]["cached_span_tokens"] > 0 and len(late["meta_info"]["input_token_logprobs"]) == 2


@pytest.fixture(scope="module")
def tiny_llama_1k(tmp_path_factory: pytest.TempPathFactory):
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long"), "llama", name="llama_1k", max_position_embeddings=1024)


def test_isps_under_memory_pressure_computes_about_what_fcfs_does(tiny_llama_1k):
    """A pool that holds the spans of only a few requests: span jobs would evict the spans staged for waiting
    requests before those run and compute them again (2.1x FCFS's prefill tokens here before the pressure mode);
    under pressure the blocked requests compute their own spans like FCFS, with the same tokens."""
    import random

    rng = random.Random(0)
    docs = [f"Record {i}: the village of {i} grew barley, kept {i % 7} goats and sold cheese at the river market."
            for i in range(30)]
    texts = [f"Reader {i}." + "".join(span(docs[j]) for j in rng.sample(range(30), 4)) + "Answer?" for i in range(40)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    computed, outputs = {}, {}
    for policy in ("fcfs", "isps"):
        with Engine(
            **ISOLATED, model_path=str(tiny_llama_1k), dtype="float32", max_total_tokens=768, schedule_policy=policy,
                    max_running_requests=8) as engine:
            outputs[policy] = [o["output_ids"] for o in engine.generate(texts, params)]
            computed[policy] = engine.get_stats()["computed_prefill_tokens"]
    assert outputs["isps"] == outputs["fcfs"]
    assert computed["isps"] <= 1.3 * computed["fcfs"], computed


def test_an_aborted_span_job_is_replaced_for_the_requests_that_need_its_span(tiny_llama):
    with Engine(
        **ISOLATED, model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, schedule_policy="isps"
    ) as engine:
        sched = engine.scheduler
        (job,) = sched.add_span_jobs([ReqSegment.from_wire(s) for s in engine.request_builder.span_segments([DOCS[0]])])
        assert sched.abort_request(job.rid) is not None
        (req,) = engine.make_reqs(GenerateReqInput(text="Q." + span(DOCS[0]) + "A?", sampling_params=GREEDY))
        sched.add_request(req)
        for _ in range(40):
            sched.step()
            if req.finished():
                break
        assert req.finished() and req.finished_reason.type == "length"
