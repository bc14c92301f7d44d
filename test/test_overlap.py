"""Overlap scheduling: each step is launched before the previous one's tokens are committed, and the output is the
same as committing each step before the next."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from test_engine import PROMPTS, assert_idle_accounting

PROMPTS4 = PROMPTS + ["Tools are described once and reused by every agent call that"]


@dataclass
class RunStats:
    ahead: int = 0  # forwards launched while the step before was uncommitted
    ahead_extends: int = 0  # of them, prefill steps
    steps: int = 0  # forwards in all
    retractions: int = 0


def run(
    path, params: list[dict], overlap: bool, prompts: list[str] = PROMPTS4, generate_kwargs: dict | None = None,
    **kwargs,
) -> tuple[list[dict], RunStats]:
    """Outputs, and how the steps ran."""
    kwargs = {"max_total_tokens": 2048, **kwargs}
    with Engine(model_path=str(path), dtype="float32", disable_overlap_schedule=not overlap, **kwargs) as engine:
        sched = engine.scheduler
        forward = engine.runner.forward_local
        stats = RunStats()

        def counting_forward(batch):
            if sched.last_step is not None:
                stats.ahead += 1
                stats.ahead_extends += batch.forward_mode.is_extend()
            return forward(batch)

        engine.runner.forward_local = counting_forward
        outs = engine.generate(prompts, params, **(generate_kwargs or {}))
        assert_idle_accounting(engine)
        stats.steps = sched.stats.num_steps
        stats.retractions = sched.stats.num_retractions
    return outs, stats


def mixed_params(stop_token: int) -> list[dict]:
    """Requests that end at different steps, by length and by a stop token, greedy and seeded."""
    return [
        {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True, "stop_token_ids": [stop_token]},
        {"temperature": 0.9, "top_p": 0.9, "sampling_seed": 7, "max_new_tokens": 14, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
    ]


def test_overlap_gives_same_tokens_and_finishes(tiny_llama):
    plain = [{"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}] * len(PROMPTS4)
    reference, plain_off = run(tiny_llama, plain, overlap=False)
    plain_outs, plain_on = run(tiny_llama, plain, overlap=True)
    assert [o["output_ids"] for o in plain_outs] == [o["output_ids"] for o in reference]
    assert plain_on.steps == plain_off.steps  # no step is launched for requests that end by length before it
    stop_token = reference[1]["output_ids"][6]  # request 1 stops early while the others go on
    params = mixed_params(stop_token)
    expected, off = run(tiny_llama, params, overlap=False)
    outs, on = run(tiny_llama, params, overlap=True)
    assert off.ahead == 0
    assert on.ahead > 10  # nearly every decode step ran ahead of the commit of the one before
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [o["meta_info"]["finish_reason"] for o in expected]
    assert len(outs[1]["output_ids"]) < 20 and len(outs[3]["output_ids"]) == 3


@pytest.mark.parametrize(
    "extra",
    [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.8, "presence_penalty": 0.5}, "min_new_tokens"],
    ids=["repetition", "frequency-presence", "min-new-tokens"],
)
def test_sampling_that_reads_the_output_runs_ahead_with_same_tokens(tiny_llama, extra):
    """Penalties count each sampled token on the device at once and the min_new_tokens ban counts the uncommitted
    token, so these steps run ahead too and sample what committing every step first samples."""
    plain = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    params = [plain] * 3
    if extra == "min_new_tokens":  # the stop token would end request 3 at its 3rd token; the ban holds it to 6+
        reference, _ = run(tiny_llama, [plain] * 4, overlap=False)
        extra = {"stop_token_ids": [reference[3]["output_ids"][2]], "min_new_tokens": 6}
    params.append({**plain, **extra})
    expected, _ = run(tiny_llama, params, overlap=False)
    outs, on = run(tiny_llama, params, overlap=True)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [o["meta_info"]["finish_reason"] for o in expected]
    assert on.ahead > 5


def test_logprobs_are_read_with_their_tokens(tiny_llama):
    """Output and prompt logprobs are computed on the device and read with the tokens, so their steps run ahead."""
    params = [{"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}] * len(PROMPTS4)
    logprobs = dict(return_logprob=[True, False, True, True], top_logprobs_num=[2, 0, 0, 3],
                    logprob_start_len=[-1, -1, 1, -1])
    expected, _ = run(tiny_llama, params, overlap=False, generate_kwargs=logprobs)
    outs, on = run(tiny_llama, params, overlap=True, generate_kwargs=logprobs)
    assert on.ahead > 5
    for got, want in zip(outs, expected):
        assert got["output_ids"] == want["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
            assert got["meta_info"].get(key) == want["meta_info"].get(key)
    assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 8
    assert [t for _, t, *_ in outs[3]["meta_info"]["output_token_logprobs"]] == outs[3]["output_ids"]
    assert all(len(top) == 3 for top in outs[3]["meta_info"]["output_top_logprobs"])


def test_token_ids_logprobs_are_the_models(tiny_llama):
    """token_ids_logprob: at each scored prompt position and each output token, the logprobs of the asked ids, as the
    model gives them (steps launched ahead, a prefill in chunks); one list per prompt or one for all."""
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS4[1] + " " + PROMPTS4[-1]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    asked = [5, 17, 3]
    kwargs = dict(return_logprob=True, logprob_start_len=[0, 6], token_ids_logprob=[asked, [9]])
    outs, on = run(tiny_llama, [params] * 2, overlap=True, prompts=[prompt] * 2, generate_kwargs=kwargs,
                   chunked_prefill_size=8)
    assert on.ahead_extends >= 2
    whole, late = outs[0]["meta_info"], outs[1]["meta_info"]
    ids = [t for _, t, *_ in whole["input_token_logprobs"]] + outs[0]["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    n_prompt = whole["prompt_tokens"]
    assert whole["input_token_ids_logprobs"][0] is None and len(whole["input_token_ids_logprobs"]) == n_prompt
    scored = whole["input_token_ids_logprobs"][1:] + whole["output_token_ids_logprobs"]
    assert len(scored) == n_prompt - 1 + 4
    for pos, row in enumerate(scored):
        assert [t for _, t, *_ in row] == asked
        assert [v for v, *_ in row] == pytest.approx(lp[pos, asked].tolist(), abs=1e-4)
    assert [row[0][1] for row in late["input_token_ids_logprobs"] + late["output_token_ids_logprobs"]] == [9] * (
        n_prompt - 6 + 4
    )
    assert [row[0][0] for row in late["output_token_ids_logprobs"]] == pytest.approx(lp[n_prompt - 1 :, 9].tolist(),
                                                                                     abs=1e-4)
    shared, _ = run(tiny_llama, [params] * 2, overlap=True, prompts=[prompt] * 2,
                    generate_kwargs=dict(return_logprob=True, token_ids_logprob=[9]))
    for out in shared:
        rows = out["meta_info"]["output_token_ids_logprobs"]
        assert [t for (_, t, _), in rows] == [9] * 4
        assert [v for (v, _, _), in rows] == pytest.approx([v for (v, _, _), in late["output_token_ids_logprobs"]],
                                                            abs=1e-4)


def test_prompt_logprobs_over_prefill_chunks_are_the_models(tiny_llama):
    """Prompt logprobs are recorded when their step commits, chunk after chunk of a prefill launched ahead: each is
    the model's log-softmax at its position (the first prompt token once, without one), from `logprob_start_len`."""
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS4[1] + " " + PROMPTS4[-1]
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    kwargs = dict(return_logprob=True, top_logprobs_num=[2, 0], logprob_start_len=[0, 5])
    outs, on = run(tiny_llama, [params] * 2, overlap=True, prompts=[prompt] * 2, generate_kwargs=kwargs,
                   chunked_prefill_size=8)
    assert on.ahead_extends >= 2
    whole, late = outs[0]["meta_info"], outs[1]["meta_info"]
    ids = [t for _, t, *_ in whole["input_token_logprobs"]]
    assert len(ids) == whole["prompt_tokens"] > 3 * 8
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = [lp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert whole["input_token_logprobs"][0][0] is None and whole["input_top_logprobs"][0] is None
    assert [v for v, *_ in whole["input_token_logprobs"][1:]] == pytest.approx(want, abs=1e-4)
    for i, top in enumerate(whole["input_top_logprobs"][1:]):
        assert [t for _, t, *_ in top] == lp[i].topk(2).indices.tolist()
    assert [t for _, t, *_ in late["input_token_logprobs"]] == ids[5:]
    assert [v for v, *_ in late["input_token_logprobs"]] == pytest.approx(want[4:], abs=1e-4)


def test_abort_while_a_step_is_in_flight(tiny_llama):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        expected = engine.generate(PROMPTS[1], params)["output_ids"]
        sched = engine.scheduler
        reqs = engine.make_reqs(GenerateReqInput(text=PROMPTS[:2], sampling_params=params))
        for req in reqs:
            sched.add_request(req)
        while sched.last_step is None:
            sched.step()
        assert sched.abort_request(reqs[0].rid) is reqs[0]
        while not reqs[1].finished():
            sched.step()
        assert reqs[1].output_ids == expected
        assert reqs[0].finished_reason.type == "abort"
        assert_idle_accounting(engine)


def test_abort_of_the_last_running_request_leaves_the_scheduler_idle(tiny_llama):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        sched = engine.scheduler
        (req,) = engine.make_reqs(GenerateReqInput(text=PROMPTS[0], sampling_params=params))
        sched.add_request(req)
        while sched.last_step is None:
            sched.step()
        sched.abort_request(req.rid)
        assert_idle_accounting(engine)


def test_span_prompts_and_chunked_prefills_run_ahead_with_same_tokens(tiny_llama):
    """Prefill steps (span jobs, chunks of a long prompt, extends behind cached spans, with the decodes riding
    along under ISPS) are launched before the step before them is committed, and change no token."""
    doc_a = span("Position-free keys are rotated inside attention from each request's own positions.")
    doc_b = span("The radix tree keys every span on its own tokens, so one copy serves every offset.")
    prompts = [
        "First question." + doc_a + doc_b + "Which doc speaks of rotation?",
        doc_b + "Second question, with the other span first." + doc_a + "Why?",
        "A long plain prompt that is cut into several prefill chunks, " * 6,
        doc_a + "Short.",
    ]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (9, 14, 6, 11)]
    expected, _ = run(tiny_llama, params, overlap=False, prompts=prompts, chunked_prefill_size=16)
    outs, on = run(tiny_llama, params, overlap=True, prompts=prompts, chunked_prefill_size=16)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [o["meta_info"]["cached_tokens"] for o in expected]
    assert on.ahead_extends > 2


def test_seats_of_requests_ending_by_length_go_to_waiting_ones_at_once(tiny_llama):
    """With two seats, the requests ending in the step in flight hand their seats over without waiting for its
    commit: no more steps than committing every step first."""
    prompts = [f"{p} number {i}" for i, p in enumerate(PROMPTS * 2)]
    params = [{"temperature": 0, "max_new_tokens": 3 + 2 * (i % 3), "ignore_eos": True} for i in range(len(prompts))]
    expected, off = run(tiny_llama, params, overlap=False, prompts=prompts, max_running_requests=2)
    outs, on = run(tiny_llama, params, overlap=True, prompts=prompts, max_running_requests=2)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert on.ahead > 0
    assert on.steps == off.steps


def test_a_step_reports_each_request_once(tiny_llama):
    """A call that commits the step in flight and then its own step at once (a request that needs its tokens on
    the host joined) reports each request once: the server sends one delta per reported request."""
    plain = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as engine:
        sched = engine.scheduler
        build = engine.make_reqs
        (a,) = build(GenerateReqInput(text=PROMPTS[0], sampling_params=plain))
        (b,) = build(GenerateReqInput(text=PROMPTS[1], sampling_params={**plain, "repetition_penalty": 1.2}))
        sched.add_request(a)
        while sched.last_step is None:
            sched.step()
        sched.add_request(b)
        reports = []
        while not (a.finished() and b.finished()):
            reports.append(sched.step())
        assert all(len(r) == len(set(map(id, r))) for r in reports)
        assert_idle_accounting(engine)


@pytest.mark.slow  # a long mixed workload, run twice
def test_mixed_workload_under_retraction_matches_committed_run(tiny_llama):
    """Spans, chunked prefills, retractions under a small pool with pages of 4, and every sampling feature at once:
    the same tokens, logprobs and finish reasons as committing every step first, and exact idle accounting."""
    doc = span("Position-free keys are rotated inside attention from each request's own positions, so one copy "
               "of a span's KV serves every offset.")
    prompts = [(f"Question {i}: " + doc + f"What is said about keys, variant {i}?") if i % 3 == 0
               else f"{PROMPTS[i % 3]} with number {i}" for i in range(12)]
    kinds = [
        {"temperature": 0, "ignore_eos": True},
        {"temperature": 0.9, "top_p": 0.9, "sampling_seed": 11, "ignore_eos": True},
        {"temperature": 0, "repetition_penalty": 1.4, "frequency_penalty": 0.3},
        {"temperature": 0.7, "top_k": 8, "sampling_seed": 5, "min_new_tokens": 9, "stop_token_ids": [1, 2, 3]},
    ]
    params = [{**kinds[i % 4], "max_new_tokens": 36 + 4 * (i % 3)} for i in range(len(prompts))]
    logprobs = {"return_logprob": [i % 2 == 0 for i in range(len(prompts))], "top_logprobs_num": 2}
    small = dict(max_total_tokens=256, page_size=4, chunked_prefill_size=32)
    expected, off = run(tiny_llama, params, overlap=False, prompts=prompts, generate_kwargs=logprobs, **small)
    outs, on = run(tiny_llama, params, overlap=True, prompts=prompts, generate_kwargs=logprobs, **small)
    assert on.ahead > 10 and on.retractions > 0 and off.retractions > 0
    for got, want in zip(outs, expected):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        # Batches differ in size between the runs, so float32 sums may differ in the last bits.
        got_lp, want_lp = (o["meta_info"].get("output_token_logprobs") or [] for o in (got, want))
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]
        assert [v for v, _, _ in got_lp] == pytest.approx([v for v, _, _ in want_lp], abs=1e-4)
