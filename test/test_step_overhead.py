"""The host fast paths of a scheduler step give what the general paths give, and the step-overhead bench runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_step_overhead  # noqa: E402

from sglang_pic.sampling.sampler import Sampler  # noqa: E402
from sglang_pic.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang_pic.tokenizer import fast_decode, load_tokenizer  # noqa: E402
from sglang_pic.utils_tensor import host_tensor, upload  # noqa: E402
from test_sampling import batch_info  # noqa: E402


def test_upload_keeps_values_and_dtype():
    assert upload([3, -1], [2**40], device="cpu").tolist() == [3, -1, 2**40]
    assert upload([True, False], device="cpu").tolist() == [1, 0]
    empty = upload([], [], device="cpu")
    assert empty.dtype == torch.int64 and empty.numel() == 0
    floats = host_tensor([0.7], [1.0], dtype=torch.float32)
    assert floats.dtype == torch.float32
    assert torch.equal(floats, torch.tensor([0.7, 1.0], dtype=torch.float32))


def test_fast_decode_matches_the_tokenizer(tiny_llama):
    tok = load_tokenizer(str(tiny_llama))
    decode = fast_decode(tok)
    assert decode is not tok.decode  # the tiny tokenizer takes the fast path
    text = "The quick brown fox said hello to everyone in the room."
    ids = tok.encode(text, add_special_tokens=True) + [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    for cut in (0, 1, 5, len(ids)):
        for skip in (False, True):
            for spaces in (False, True):
                expected = tok.decode(ids[:cut], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                got = decode(ids[:cut], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                assert got == expected, (cut, skip, spaces)
    assert decode(ids[-3:]) == tok.decode(ids[-3:])


def test_fast_decode_keeps_a_tokenizer_that_cleans_up(tiny_llama):
    tok = load_tokenizer(str(tiny_llama))
    tok.clean_up_tokenization_spaces = True
    assert fast_decode(tok) == tok.decode


@pytest.mark.parametrize(
    "params, plain",
    [
        (SamplingParams(temperature=0), True),
        (SamplingParams(temperature=0.8, top_k=1), True),
        (SamplingParams(temperature=0.8), False),
        (SamplingParams(temperature=0, repetition_penalty=1.3), False),
        (SamplingParams(temperature=0, frequency_penalty=0.5), False),
        (SamplingParams(temperature=0, presence_penalty=-0.5), False),
        (SamplingParams(temperature=0, logit_bias={1: -5.0}), False),
        (SamplingParams(temperature=0, min_new_tokens=1, max_new_tokens=4), False),
    ],
)
def test_plain_greedy_means_the_sampler_picks_the_argmax(params, plain):
    assert params.is_plain_greedy == plain
    if not plain:
        return
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    info = batch_info([params] * 4, vocab_size=10, output_ids=[[1, 2]] * 4, prompt_ids=[[3]] * 4, eos=[{0}] * 4)
    assert torch.equal(Sampler()(logits, info), logits.argmax(dim=-1))


def test_step_overhead_bench_runs(tmp_path):
    model = tmp_path / "tiny-llama-4k"
    results = bench_step_overhead.main(
        ["--batch-sizes", "16", "--steps", "3", "--corpus-size", "12", "--passages", "3", "--new-tokens", "8",
         "--model-path", str(model), "--out", str(tmp_path / "overhead.json")]
    )
    assert [(r.phase, r.batch_size) for r in results] == [("decode", 16), ("mixed", 16)]
    for r in results:
        assert r.steps == 3 and r.host_ms > 0 and r.forward_ms > 0
        assert r.host_ms == pytest.approx(r.sched_ms + r.output_ms + r.gc_ms)
    decode, mixed = results
    assert decode.running_mean == 16 and decode.prefill_tokens_mean == 0
    assert mixed.prefill_tokens_mean > 0
    assert (tmp_path / "overhead.json").stat().st_size > 0
