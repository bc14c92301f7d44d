"""Penalties read token counts that PenaltyCounts keeps on the device between steps; they must always equal counts
made from scratch from each request's prompt and output, whoever joins, finishes or drafts."""

from __future__ import annotations

import random

import torch

from sglang_pic import Engine
from sglang_pic.managers.req import FinishReason, Req
from sglang_pic.sampling.penalty_counts import PenaltyCounts
from sglang_pic.sampling.sampling_params import SamplingParams
from test_engine import assert_retraction_keeps_tokens
from test_sampling import make_req

V = 50


def counts_from_scratch(req: Req, extra: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.bincount(torch.tensor(req.output_ids + extra, dtype=torch.int64), minlength=V).float()
    prompt = torch.bincount(torch.tensor(req.prompt_ids(), dtype=torch.int64), minlength=V) > 0
    if req.sampling_params.repetition_penalty == 1.0:
        prompt[:] = False
    return out, prompt | (out > 0)


def test_counts_follow_outputs_through_joins_finishes_and_growth():
    rng = random.Random(0)
    table = PenaltyCounts(V, "cpu")
    kinds = [
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=0.3, repetition_penalty=0.9),
        SamplingParams(),  # no penalty: gathers the zero row
    ]
    live: list[Req] = []
    peak_rows = 0
    for step in range(60):
        # Up to 3 requests join; some finish (their rows are reused by later ones); everyone else outputs 1-3 tokens.
        for j in range(rng.randrange(4)):
            prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
            live.append(make_req(kinds[rng.randrange(len(kinds))], prompt_ids=prompt, rid=f"s{step}-{j}"))
        for req in list(live):
            if rng.random() < 0.1:
                req.finished_reason = FinishReason("length")
                live.remove(req)
        for req in live:
            for _ in range(rng.randrange(1, 4)):
                req.append_output(rng.randrange(V))
        if not live:
            continue
        extras = [[rng.randrange(V) for _ in range(rng.randrange(3))] for _ in live]
        history = table.history(live, extras, want_seen=True)
        for i, req in enumerate(live):
            counts, seen = counts_from_scratch(req, extras[i])
            if req.sampling_params == kinds[3]:
                counts, seen = torch.zeros(V), torch.zeros(V, dtype=torch.bool)
            assert torch.equal(history.output_counts[i], counts), (step, req.rid)
            assert torch.equal(history.seen[i], seen), (step, req.rid)
        peak_rows = max(peak_rows, len(table.rows))
        # The drafted extras were not committed: the table itself is untouched by them.
        assert len(table.rows) + len(table.free) == table.output_counts.shape[0] - 1
    assert peak_rows > 8  # the table grew past its first allocation
    # Freed rows are zero again, so a request that takes one starts from nothing.
    for index in table.free:
        assert not table.output_counts[index].any() and not table.prompt_seen[index].any()


def test_history_without_seen_when_no_repetition_penalty():
    table = PenaltyCounts(V, "cpu")
    req = make_req(SamplingParams(frequency_penalty=1.0), prompt_ids=[1, 2], rid="a")
    req.append_output(3)
    history = table.history([req])
    assert history.seen is None
    assert history.output_counts[0, 3] == 1 and history.output_counts[0].sum() == 1


PENALTY_PROMPTS = [
    "The quick brown fox jumps over the lazy dog and",
    "Once upon a time",
    "Answer briefly: where is Paris?",
    "one two three one two three one two",
]
PENALTIES = [
    {"repetition_penalty": 1.5},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0, "repetition_penalty": 0.8},
    {},
]
LENGTHS = [14, 6, 10, 12]  # requests finish at different steps; later rows run in smaller batches


def penalized_greedy_reference(path, prompt: str, penalties: dict, n: int) -> list[int]:
    """Step-by-step forward of the HF model, penalties applied by hand from the full history."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids[0].tolist()
    prompt_len, out = len(ids), []
    rp = penalties.get("repetition_penalty", 1.0)
    fp = penalties.get("frequency_penalty", 0.0)
    pp = penalties.get("presence_penalty", 0.0)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        vocab = logits.shape[0]
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[ids] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        counts = torch.bincount(torch.tensor(ids[prompt_len:], dtype=torch.int64), minlength=vocab).float()
        logits = logits - fp * counts - pp * (counts > 0).float()
        nxt = int(logits.argmax())
        ids.append(nxt)
        out.append(nxt)
    return out


def test_engine_penalties_match_a_from_scratch_reference(tiny_llama):
    params = [
        {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **p} for p, n in zip(PENALTIES, LENGTHS)
    ]
    with Engine(model_path=str(tiny_llama), dtype="float32") as engine:
        outs = engine.generate(PENALTY_PROMPTS, params)
        rows = engine.runner.sampler.penalties
        again = engine.generate(PENALTY_PROMPTS[0], params[0])
        assert len(rows.rows) <= 1  # finished requests hand their rows back (lazily, at the next penalised step)
    expected = [
        penalized_greedy_reference(tiny_llama, p, pen, n) for p, pen, n in zip(PENALTY_PROMPTS, PENALTIES, LENGTHS)
    ]
    assert [o["output_ids"] for o in outs] == expected
    assert again["output_ids"] == expected[0]
    # The penalties changed the output: without them the first prompt's greedy text differs.
    plain = penalized_greedy_reference(tiny_llama, PENALTY_PROMPTS[0], {}, LENGTHS[0])
    assert plain != expected[0]


def test_rows_of_aborted_requests_are_freed():
    table = PenaltyCounts(V, "cpu")
    req = make_req(SamplingParams(frequency_penalty=1.0, repetition_penalty=1.1), prompt_ids=[1], rid="a")
    req.append_output(2)
    table.history([req], want_seen=True)
    req.finished_reason = FinishReason("abort", message="aborted")
    other = make_req(SamplingParams(repetition_penalty=1.1), prompt_ids=[3], rid="b")
    history = table.history([other], want_seen=True)
    assert list(table.rows) == [other]
    assert history.seen[0].nonzero().flatten().tolist() == [3]


def test_penalised_requests_keep_their_counts_through_retraction(tiny_qwen2):
    """A retracted request computes its KV again but keeps its output, so its row stays valid: the tokens equal a
    run with room for everyone."""
    prompts = [f"{p} number {i}" for i, p in enumerate(PENALTY_PROMPTS * 3)]
    params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, **PENALTIES[i % 3]} for i in range(12)]
    assert_retraction_keeps_tokens(tiny_qwen2, prompts, params)


def test_sampled_tokens_count_before_their_commit():
    """Overlap scheduling samples step N+1 before step N's tokens are appended: add_sampled counts them on the
    device at once, and the catch-up from the output never counts them twice."""
    rng = random.Random(1)
    table = PenaltyCounts(V, "cpu")
    kinds = [SamplingParams(frequency_penalty=0.5), SamplingParams(repetition_penalty=1.2), SamplingParams()]
    reqs = [make_req(kinds[i % 3], prompt_ids=[rng.randrange(V) for _ in range(5)], rid=f"r{i}") for i in range(6)]
    pending: list[int] | None = None
    for _ in range(25):
        history = table.history(reqs, want_seen=True)  # step N+1 samples while step N's tokens are pending
        for i, req in enumerate(reqs):
            counts, seen = counts_from_scratch(req, [pending[i]] if pending else [])
            if req.sampling_params == kinds[2]:
                counts, seen = torch.zeros(V), torch.zeros(V, dtype=torch.bool)
            assert torch.equal(history.output_counts[i], counts)
            assert torch.equal(history.seen[i], seen)
        sampled = [rng.randrange(V) for _ in reqs]
        table.add_sampled(reqs, torch.tensor(sampled))
        if pending:  # step N is committed after step N+1 was launched
            for req, tok in zip(reqs, pending):
                req.append_output(tok)
        pending = sampled
