"""Engine core against Hugging Face transformers: greedy tokens, prefix caching, memory accounting, retraction."""

from __future__ import annotations

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req_kv import SHARED_PREFIX_MIN

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little town by the sea where",
    "A serving engine batches requests, caches keys and values",
]
NEW_TOKENS = 12


def hf_greedy(path, prompts: list[str], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1)
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def greedy(n: int = NEW_TOKENS) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def assert_idle_accounting(engine: Engine) -> None:
    sched = engine.scheduler
    assert sched.is_idle()
    alloc = engine.runner.allocator
    assert alloc.available_size() + sched.tree.total_size() == alloc.size
    assert sched.tree.protected_size() == 0
    assert not sched.kv.inflight_spans and not sched.kv.inflight_prefixes


@pytest.fixture(scope="module")
def hf_reference(tiny_model) -> tuple:
    return tiny_model, hf_greedy(tiny_model, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize(
    "page_size,chunked_prefill_size", [(1, None), (1, 5), (16, None), (16, 7)], ids=["p1", "p1-chunk", "p16", "p16-chunk"]
)
def test_greedy_matches_transformers(hf_reference, page_size, chunked_prefill_size):
    path, expected = hf_reference
    with Engine(
        model_path=str(path), dtype="float32", page_size=page_size, chunked_prefill_size=chunked_prefill_size,
        max_total_tokens=2048,
    ) as engine:
        outs = engine.generate(PROMPTS, greedy())
        assert [o["output_ids"] for o in outs] == expected
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert_idle_accounting(engine)


def test_prefix_cache_hit_gives_same_tokens(tiny_llama):
    base = "Once upon a time there was a little town by the sea where fishermen told stories"
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        first = engine.generate(base + " every night", greedy())
        second = engine.generate(base + " to the children", greedy())
        assert first["meta_info"]["cached_tokens"] == 0
        assert second["meta_info"]["cached_tokens"] > 10
        assert_idle_accounting(engine)
    with Engine(model_path=str(tiny_llama), dtype="float32", disable_radix_cache=True, max_total_tokens=2048) as cold:
        ref = cold.generate(base + " to the children", greedy())
        assert ref["meta_info"]["cached_tokens"] == 0
        assert_idle_accounting(cold)
    assert second["output_ids"] == ref["output_ids"]


@pytest.mark.parametrize("chunked_prefill_size", [None, 48])
def test_concurrent_requests_compute_a_shared_uncached_prefix_once(tiny_llama, chunked_prefill_size):
    """n samples of one prompt, and prompts sharing a long uncached prefix sent together, compute the shared tokens
    once: the others wait for them (across chunks too) and then find them in the tree, with the same tokens."""
    base = "Once upon a time there was a little town by the sea where fishermen told stories " * 3
    prompts = [base + tail for tail in ("every night", "to the children", "about the storm")]
    with Engine(model_path=str(tiny_llama), dtype="float32", disable_radix_cache=True, max_total_tokens=2048) as cold:
        expected = [o["output_ids"] for o in cold.generate(prompts, greedy())]
    with Engine(
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, chunked_prefill_size=chunked_prefill_size,
        span_head_tokens=0,
    ) as engine:
        stats = engine.scheduler.stats
        n_base = len(engine.tokenizer.encode(base))
        outs = engine.generate(prompts, greedy())
        assert [o["output_ids"] for o in outs] == expected
        assert stats.computed_prefill_tokens < n_base + 3 * 8  # not 3 * n_base
        assert [o["meta_info"]["cached_tokens"] > 0 for o in outs] == [False, True, True]
        engine.flush_cache()
        before = stats.computed_prefill_tokens
        samples = engine.generate(prompts[0], {**greedy(), "n": 4})
        assert [o["output_ids"] for o in samples] == [expected[0]] * 4
        n_prompt = samples[0]["meta_info"]["prompt_tokens"]
        assert stats.computed_prefill_tokens - before == n_prompt + 3  # the copies compute their last token only
        # with a span: the question after it (a PDEP segment, keyed on the whole prompt) is shared the same way
        question = " Now answer the question about the story above in a few careful words please." * 2
        before = stats.computed_prefill_tokens
        with_span = engine.generate("Read this." + span(base) + question, {**greedy(), "n": 3})
        n_prompt = with_span[0]["meta_info"]["prompt_tokens"]
        # a copy computes itself the last tokens of a segment that are fewer than SHARED_PREFIX_MIN when it matches
        extra = 2 if chunked_prefill_size is None else 2 * SHARED_PREFIX_MIN
        anchor = len(engine.request_builder.span_policy.anchor)  # the span job computes it too (span_policy.py)
        assert stats.computed_prefill_tokens - before <= n_prompt + extra + anchor
        assert len({tuple(o["output_ids"]) for o in with_span}) == 1
        assert_idle_accounting(engine)


def assert_retraction_keeps_tokens(path, prompts: list[str], params: dict | list[dict]) -> None:
    """A pool of 256 tokens forces retractions; the tokens must equal a run with room for everyone."""
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=4096) as big:
        expected = [o["output_ids"] for o in big.generate(prompts, params)]
    with Engine(
        model_path=str(path), dtype="float32", max_total_tokens=256, page_size=4, chunked_prefill_size=32
    ) as small:
        outs = small.generate(prompts, params)
        assert small.scheduler.stats.num_retractions > 0
        assert [o["output_ids"] for o in outs] == expected
        assert_idle_accounting(small)


def test_retraction_under_small_pool_gives_same_tokens(tiny_qwen2):
    assert_retraction_keeps_tokens(tiny_qwen2, [f"{p} number {i}" for i, p in enumerate(PROMPTS * 3)], greedy(40))


def test_abort_frees_memory(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        stream = engine.generate(PROMPTS[1], greedy(50), stream=True)
        chunks = [next(stream) for _ in range(3)]
        assert chunks[-1]["meta_info"]["completion_tokens"] >= 3
        stream.close()
        assert_idle_accounting(engine)


def test_stream_interval(tiny_llama):
    """--stream-interval 3: the first token at once, then every third, then the end; the text is unchanged."""
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, stream_interval=3) as engine:
        whole = engine.generate(PROMPTS[0], greedy(11))
        chunks = list(engine.generate(PROMPTS[0], greedy(11), stream=True))
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 4, 7, 10, 11]
        assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    with pytest.raises(ValueError, match="stream_interval"):
        Engine(model_path=str(tiny_llama), stream_interval=0)


def test_shutdown_keeps_only_the_final_stats(tiny_llama):
    """A shut-down engine drops its scheduler and runner (their weights and pools: see test_gpu_engine for the
    device memory) and says so when used again; its stats stay readable."""
    engine = Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048)
    engine.generate(PROMPTS[0], greedy(3))
    engine.shutdown()
    engine.shutdown()  # twice is harmless
    assert engine.scheduler is None and engine.runner is None
    assert engine.get_stats()["generation_tokens"] == 3
    for call in (lambda: engine.generate(PROMPTS[0], greedy(3)), engine.flush_cache, lambda: engine.warm_spans(["x"])):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["tree", "no-tree"])
def test_release_frees_the_slots_the_request_was_given_not_what_its_row_says(tiny_llama, disable_radix_cache):
    """A request's own slots are freed from the host record kept as they were allocated: its row in req_to_token
    lives on the device, and reading it back would wait for the step in flight. Scribbling over the row before
    the release shows the row is not read."""
    with Engine(model_path=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=2048,
                disable_radix_cache=disable_radix_cache) as engine:
        kv = engine.scheduler.kv
        (req,) = engine.make_reqs(
            GenerateReqInput(text=PROMPTS[1] + " by", sampling_params=greedy())
        )
        req.req_pool_idx = engine.runner.req_to_token_pool.alloc()
        kv.match(req)
        kv.alloc(req, [len(s.tokens) - s.done for s in req.segments])  # as if its prefill had run
        kv.cache(req)
        assert any(seg.own for seg in req.segments)  # a partial page (or, with no tree, everything) is its own
        engine.runner.req_to_token_pool.req_to_token[req.req_pool_idx].fill_(4)  # page 1: not this request's
        kv.release(req)
        assert_idle_accounting(engine)


def test_stream_matches_non_stream(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        full = engine.generate(PROMPTS[0], greedy())
        chunks = list(engine.generate(PROMPTS[0], greedy(), stream=True))
        assert chunks[-1]["text"] == full["text"]
        assert chunks[-1]["output_ids"] == full["output_ids"]
        assert len(chunks) == NEW_TOKENS


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt="hi " * 400), "context length"),
        (dict(input_ids=[5] * 250, sampling_params={"max_new_tokens": 100}), r"\(250 in the prompt, 100 for the"),
        (dict(prompt="hi", sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
        (dict(prompt="hi", sampling_params={"max_new_tokens": 2.5}), "max_new_tokens"),
        (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
        (dict(prompt="hi", sampling_params={"top_p": 1.5}), "top_p"),
        (dict(prompt="hi", sampling_params={"bogus": 1}), "bogus"),
        (dict(prompt=["ok", ""]), "request 1"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_llama, kwargs, needle):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        with pytest.raises(ValueError, match=needle):
            engine.generate(**kwargs)
        assert engine.generate("hello", greedy(3))["meta_info"]["completion_tokens"] == 3
        assert_idle_accounting(engine)


def test_lpm_policy_serves_longest_match_first_with_same_tokens(tiny_llama):
    base = "Once upon a time there was a little town by the sea where fishermen told stories"
    prompts = ["The weather today is sunny", base + " every night", "A serving engine", base + " to the children"]
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, schedule_policy="fcfs") as fcfs:
        expected = [o["output_ids"] for o in fcfs.generate(prompts, greedy())]
    with Engine(
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, schedule_policy="lpm",
        max_prefill_tokens=24, chunked_prefill_size=None,
    ) as lpm:
        lpm.generate(base, {"max_new_tokens": 1})
        order = []
        original = lpm.scheduler.admission._count_admission
        lpm.scheduler.admission._count_admission = lambda req: order.append(req.prompt_len) or original(req)
        outs = lpm.generate(prompts, greedy())
        assert [o["output_ids"] for o in outs] == expected
        # the two prompts sharing the cached prefix are admitted before the others
        assert sorted(order[:2]) == sorted(o["meta_info"]["prompt_tokens"] for o in (outs[1], outs[3]))
        assert_idle_accounting(lpm)
