"""Sampling parameters, batched sampling and logprob helpers, checked against small hand-made expectations."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.sampling.logprobs import SampledLogprobs, compute_logprobs
from sglang_pic.sampling.penalty_counts import PenaltyCounts
from sglang_pic.sampling.sampler import Sampler, adjust_logits, filter_probs, make_generator
from sglang_pic.sampling.sampling_batch_info import SamplingBatchInfo
from sglang_pic.sampling.sampling_params import SamplingParams

V = 6
sample = Sampler()


def make_req(
    params: SamplingParams,
    output_ids: list[int] | None = None,
    prompt_ids: list[int] | None = None,
    eos: set[int] | None = None,
    generator: torch.Generator | None = None,
    rid: str = "r",
) -> Req:
    prompt, out = list(prompt_ids or []), list(output_ids or [])
    segment = ReqSegment("prefix", prompt + out, None)
    return Req(rid, [segment], params, len(prompt), output_ids=out, eos_token_ids=set(eos or ()), generator=generator)


def batch_info(
    params: list[SamplingParams],
    vocab_size: int = V,
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    eos: list[set[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    device: str = "cpu",
) -> SamplingBatchInfo:
    n = len(params)
    reqs = [
        make_req(p, (output_ids or [None] * n)[i], (prompt_ids or [None] * n)[i], (eos or [None] * n)[i],
                 (generators or [None] * n)[i], rid=f"r{i}")
        for i, p in enumerate(params)
    ]
    return SamplingBatchInfo.from_requests(reqs, vocab_size, device, PenaltyCounts(vocab_size, device))


# ---- SamplingParams validation ----


def test_defaults_match_sglang():
    p = SamplingParams.from_dict(None)
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 0, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.seed, p.n) == (None, None, None, 1)
    assert not p.ignore_eos and p.skip_special_tokens and p.spaces_between_special_tokens and not p.no_stop_trim


def test_from_dict_nulls_mean_default_and_ints_become_floats():
    p = SamplingParams.from_dict({"temperature": 0, "top_p": None, "max_new_tokens": 5, "sampling_seed": 7})
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.top_p == 1.0 and p.max_new_tokens == 5 and p.seed == 7
    assert p.is_greedy and SamplingParams(top_k=1).is_greedy and not SamplingParams().is_greedy


@pytest.mark.parametrize(
    "d, field",
    [
        ({"max_new_tokens": "5"}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"n": 0}, "n must"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": 1.0}, "seed"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": "big"}}, "logit_bias"),
        ({"temprature": 0.5, "topp": 1}, "temprature, topp"),
        ({"regex": "a+", "json_schema": "{}"}, "at most one of json_schema, regex, ebnf, structural_tag"),
        ({"regex": ["a+"]}, "regex must be a string"),
        ({"stop_regex": "(a"}, "is not a valid regular expression"),
        ({"stop_regex": ["ok", "a*"]}, "can match an empty string"),
        ({"stop_regex": 3}, "stop_regex must be a string or a list of strings"),
    ],
)
def test_from_dict_rejects(d, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(d)


def test_verify_checks_vocabulary_and_rechecks_mutations():
    SamplingParams(stop_token_ids=[9], logit_bias={"9": -5}).verify(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[3, 10]).verify(vocab_size=10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).verify(vocab_size=10)
    p = SamplingParams()
    p.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        p.verify(vocab_size=10)


def test_normalize_stop():
    class CharPairs:
        def encode(self, text, add_special_tokens=True):
            return list(range((len(text) + 1) // 2))

    p = SamplingParams(stop="</s>", stop_regex=r"\d{2}")
    p.normalize()
    assert p.stop == ["</s>"] and p.stop_regex == [r"\d{2}"] and p.stops.window == 5  # 4 characters + 1
    p = SamplingParams(stop=["ab", "abcde"])
    p.normalize(CharPairs())
    assert p.stops.window == 4  # 3 tokens + 1
    p = SamplingParams()
    p.normalize()
    assert p.stop == [] and p.stops is None


# ---- Sampler ----


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.randn(8, 50)
    logits[0, 7] = logits[0, 3] = 100.0
    ids = sample(logits, batch_info([SamplingParams(temperature=0.0)] * 8, vocab_size=50))
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.argmax(-1)) and ids[0] == 3


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    ids = sample(logits, batch_info([SamplingParams(top_k=1, temperature=1.5)] * 64, vocab_size=50))
    assert torch.equal(ids, logits.argmax(-1))
    # Not flagged greedy: goes through sorting, filtering and the noise race.
    info = batch_info([SamplingParams(top_p=1e-6, temperature=1.5)] * 64, vocab_size=50)
    assert not info.greedy_mask.any()
    assert torch.equal(sample(logits, info), logits.argmax(-1))


def test_sampler_leaves_logits_untouched():
    logits = torch.randn(2, V)
    before = logits.clone()
    info = batch_info(
        [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, min_new_tokens=2, logit_bias={"1": 2.0})] * 2,
        output_ids=[[1], [2]],
        eos=[{0}, {0}],
    )
    sample(logits, info)
    assert torch.equal(logits, before)


def test_min_p_filters_relative_to_top_token():
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(4000, 5)
    # min_p=0.3 keeps tokens with p >= 0.12: ids 0, 1, 2.
    ids = sample(logits, batch_info([SamplingParams(min_p=0.3)] * 4000, vocab_size=5))
    assert set(ids.tolist()) == {0, 1, 2}


def test_penalties_match_hand_computation():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    info = batch_info([params], vocab_size=5, prompt_ids=[[0, 1]], output_ids=[[2, 2, 3]])
    # Repetition on prompt+output tokens {0,1,2,3}: positive / 2, negative * 2 -> [0.5, -2, 1, 0.25, -0.5].
    # Then output counts (token 2 twice, token 3 once): 2 -> 1 - 2*0.5 - 0.25, 3 -> 0.25 - 0.5 - 0.25.
    expected = torch.tensor([[0.5, -2.0, -0.25, -0.5, -0.5]])
    assert torch.allclose(adjust_logits(logits, info), expected)
    assert sample(logits, info).item() == 0


def test_penalties_apply_per_row_and_skip_when_unused():
    assert batch_info([SamplingParams()] * 2, output_ids=[[1], [2]]).output_counts is None
    logits = torch.zeros(2, V)
    info = batch_info([SamplingParams(presence_penalty=1.0), SamplingParams()], output_ids=[[1, 1], [2]])
    assert info.seen_mask is None
    out = adjust_logits(logits, info)
    assert out[0, 1] == -1.0 and out[0].count_nonzero() == 1 and not out[1].any()


def test_logit_bias_is_added():
    logits = torch.zeros(1, V)
    info = batch_info([SamplingParams(temperature=0.0, logit_bias={"4": 3.0, 2: -1.0})])
    assert adjust_logits(logits, info).tolist() == [[0.0, 0.0, -1.0, 0.0, 3.0, 0.0]]
    assert sample(logits, info).item() == 4


def test_min_new_tokens_bans_eos_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, min_new_tokens=2)]
    eos = [{1, 3}]
    assert sample(logits, batch_info(params, output_ids=[[5]], eos=eos)).item() == 2
    assert sample(logits, batch_info(params, output_ids=[[5, 5]], eos=eos)).item() == 1


def test_min_new_tokens_ban_counts_an_uncommitted_token():
    """Overlap scheduling samples before the last sampled token is in the output: it counts toward min_new_tokens."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 0.0, 0.0]])
    req = make_req(SamplingParams(temperature=0.0, min_new_tokens=2), output_ids=[5], eos={1, 3})
    penalties = PenaltyCounts(V, "cpu")
    assert sample(logits, SamplingBatchInfo.from_requests([req], V, "cpu", penalties)).item() == 2
    assert sample(logits, SamplingBatchInfo.from_requests([req], V, "cpu", penalties, uncommitted=[1])).item() == 1


def test_seeded_request_is_independent_of_batch():
    vocab = 3000
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    # The companions change the filtering depth: top_k=2000 widens the candidates, the flat row's wide nucleus
    # forces a full sort.
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=2000, min_p=0.05), SamplingParams(top_p=0.99)]
    torch.manual_seed(0)
    steps = [torch.randn(len(others) + 1, vocab) * torch.tensor([[3.0], [1.0], [1.0], [0.01]]) for _ in range(6)]

    def run(mixed: bool, global_seed: int) -> list[int]:
        """The target's tokens, alone (row 0) or as row 2 among unseeded, greedy and other-seeded rows."""
        gen = make_generator(1234, "cpu")
        params, gens, row = [target], [gen], 0
        if mixed:
            params = [others[0], others[1], target, others[2]]
            gens, row = [None, None, gen, make_generator(99, "cpu")], 2
        torch.manual_seed(global_seed)  # the global RNG must not matter to a seeded row
        tokens = []
        for logits in steps:
            rows = torch.cat([logits[1:3], logits[:1], logits[3:]]) if mixed else logits[:1]
            tokens.append(sample(rows, batch_info(params, vocab_size=vocab, generators=gens))[row].item())
        return tokens

    alone = run(mixed=False, global_seed=1)
    assert alone == run(mixed=True, global_seed=2)
    assert len(set(alone)) > 1  # really sampling, not collapsing to argmax
    # A different seed gives a different stream.
    other = batch_info([target], vocab_size=vocab, generators=[make_generator(5, "cpu")])
    assert [sample(s[:1], other).item() for s in steps] != alone


def test_filtering_matches_full_sort_reference():
    """Wide vocabulary, so the partial top-k path and its full-sort fallback are both exercised."""
    torch.manual_seed(0)
    vocab = 5000
    scales = torch.tensor([[3.0], [3.0], [3.0], [0.05], [3.0], [1.0]])
    logits = torch.randn(6, vocab) * scales
    params = [
        SamplingParams(top_k=50),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=1500, top_p=0.95),
        SamplingParams(top_p=0.95),  # flat row: nucleus wider than the candidates
        SamplingParams(top_k=20, top_p=0.5, min_p=0.1),
        SamplingParams(),
    ]
    probs = torch.softmax(logits, -1)
    kept = filter_probs(probs, batch_info(params, vocab_size=vocab)) > 0
    for row, p in enumerate(params):
        ordered, order = probs[row].double().sort(descending=True)
        k = vocab if p.top_k == -1 else p.top_k
        mass = ordered[:k].sum()
        before = ordered[:k].cumsum(0) - ordered[:k]
        n = int((before < p.top_p * mass).sum()) if p.top_p < 1 else k
        expected = torch.zeros(vocab, dtype=torch.bool)
        expected[order[:n]] = True
        expected &= probs[row] >= p.min_p * probs[row].max()
        assert torch.equal(kept[row], expected), row
    assert kept[3].sum() > 1024 and kept[5].all()


def reference_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain-Python statement of the intended distribution: softmax(l/T), keep top_k, then the top_p nucleus."""
    weights = [math.exp(x / temperature) for x in logits]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k]
    mass = sum(probs[i] for i in order)
    kept, acc = [], 0.0
    for i in order:
        kept.append(i)
        acc += probs[i] / mass
        if acc >= top_p:
            break
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_distribution_chi_square(seeded):
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
    temperature, top_k, top_p = 1.2, 5, 0.9
    expected = reference_distribution(logits, temperature, top_k, top_p)
    assert sum(p > 0 for p in expected) == 4  # both filters bite: top_k drops one, top_p another

    n = 20000 if not seeded else 4000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    gens = [make_generator(i, "cpu") for i in range(n)] if seeded else None
    torch.manual_seed(2024)
    ids = sample(torch.tensor(logits).expand(n, V), batch_info(params, generators=gens))
    counts = torch.bincount(ids, minlength=V).tolist()
    support = [i for i in range(V) if expected[i] > 0]
    assert all(counts[i] == 0 for i in range(V) if expected[i] == 0)
    _, p_value = chisquare([counts[i] for i in support], [expected[i] * n for i in support])
    assert p_value > 1e-3


# ---- logprobs ----


def test_logprob_helpers():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    lp = compute_logprobs(logits)
    assert torch.allclose(lp, torch.log_softmax(logits, -1)) and lp.dtype == torch.float32
    scaled = compute_logprobs(logits, torch.tensor([[2.0], [1.0]]))
    assert torch.allclose(scaled[0], torch.log_softmax(logits[0] / 2, -1))
    sampled = SampledLogprobs.compute(lp, torch.tensor([0, 2]), [2, 0])
    (chosen0, top0, asked0), (chosen1, top1, asked1) = sampled.by_row(sampled.tensors)
    assert [t for _, t in top0] == [1, 2] and top1 == [] and asked0 is None and asked1 is None
    assert top0[0][0] == pytest.approx(lp[0, 1].item())
    assert [chosen0, chosen1] == pytest.approx([lp[0, 0].item(), lp[1, 2].item()])
    three = torch.log_softmax(torch.randn(3, 5), -1)
    sampled = SampledLogprobs.compute(three, torch.tensor([0, 1, 2]), [0, 1, 0], [[4, 0], None, [4, 0]])
    rows = sampled.by_row(sampled.tensors)
    assert rows[1][2] is None and [t for _, t in rows[0][2]] == [t for _, t in rows[2][2]] == [4, 0]
    assert [v for v, _ in rows[2][2]] == pytest.approx(three[2, [4, 0]].tolist())
    assert len(sampled.tensors) == 4  # chosen, one topk (values, ids), one gather shared by the two rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_rows_sample_on_cuda_from_their_cpu_generators():
    """Requests carry CPU generators (built with the request); CUDA logits draw a seeded row's noise from it, so a
    seed picks the same tokens on the GPU as on the CPU for the same logits."""
    vocab = 3000
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.9)]
    torch.manual_seed(0)
    steps = [torch.randn(2, vocab) * 4.0 for _ in range(8)]

    def run(device: str) -> list[int]:
        gens = [make_generator(7, "cpu"), None]
        return [sample(s.to(device), batch_info(params, vocab_size=vocab, generators=gens, device=device))[0].item()
                for s in steps]

    on_cpu = run("cpu")
    assert run("cuda") == on_cpu
    assert len(set(on_cpu)) > 1
