"""Tensor parallelism on CPU (gloo): `tp_size=2` through the offline Engine gives tp 1's greedy tokens.

The tiny models have 4 query and 2 KV heads, so each of 2 ranks holds 2 query heads and 1 KV head; a 1-KV-head
variant checks KV-head replication, and its 385-token vocabulary checks the padded vocabulary shards. A `gpu`
variant runs tp 2 and 4 on CUDA (NCCL, Triton, CUDA graphs) against the CPU tp 1 tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.model_loader.span_adapter import save_adapter
from tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from make_adapter import random_adapter  # noqa: E402

DOC = "The capital of France is Paris, the capital of Japan is Tokyo."
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little town by the sea where",
    "Answer briefly." + span(DOC) + span("Numbers like one, two, three") + "Where is Tokyo?",
    "Read this." + span(DOC) + "What is the capital of Italy?",
]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
LOGPROB_ATOL = 1e-4  # CPU float32; the GPU test allows TF32-sized differences


def run(path, tp_size: int, **engine_args) -> tuple[list[list[int]], list[list[int]], list[float], int]:
    """Tokens of a cold batch, tokens of the same batch again (spans and prefixes now cached), the output
    logprobs of one prompt, and the span tokens the second batch reused."""
    with Engine(
        model_path=str(path), dtype="float32", max_total_tokens=2048, tp_size=tp_size, span_head_tokens=4,
        span_tail_tokens=2,
        **engine_args
    ) as engine:
        cold = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        warm_outs = engine.generate(PROMPTS, GREEDY)
        logprob_out = engine.generate(PROMPTS[2], GREEDY, return_logprob=True)
    logprobs = [lp for lp, _, *_ in logprob_out["meta_info"]["output_token_logprobs"]]
    reused = sum(o["meta_info"]["cached_span_tokens"] for o in warm_outs)
    return cold, [o["output_ids"] for o in warm_outs], logprobs, reused


def assert_same(path, tp_size: int = 2, logprob_atol: float = LOGPROB_ATOL, **engine_args) -> None:
    cold1, warm1, lp1, _ = run(path, 1)
    cold2, warm2, lp2, reused = run(path, tp_size, **engine_args)
    assert cold2 == cold1
    assert warm2 == warm1 == cold1
    assert reused > 0
    assert lp2 == pytest.approx(lp1, abs=logprob_atol)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_matches_tp1(arch, request):
    """Llama (untied head, rope scaling), Qwen2 (tied embeddings, qkv bias), Qwen3 (q/k norms)."""
    assert_same(request.getfixturevalue(f"tiny_{arch}"))


@pytest.mark.parametrize("select", ["query", "deviation"])
def test_tp2_probe_chooses_what_tp1_chooses(tiny_llama, monkeypatch, select):
    """Each rank scores its own heads and the ranks' scores are summed: the probe passes (query or deviation) of
    tp 2 choose the tokens tp 1 chooses, and answer alike."""
    from probe_choices import recording
    from sglang_pic.managers import span_probe

    outs, choices = {}, {}
    for tp_size in (1, 2):
        choices[tp_size] = []
        monkeypatch.setattr(span_probe, "choose", recording(choices[tp_size]))
        with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, tp_size=tp_size,
                    span_head_tokens=2, span_query_share=0.3, span_select=select) as engine:
            outs[tp_size] = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert len(choices[1]) == 2 and sorted(map(repr, choices[2])) == sorted(map(repr, choices[1]))
    assert outs[2] == outs[1]


def test_tp2_serves_a_span_adapter_apart_as_tp1(tiny_qwen2, tmp_path):
    """The adapter's factors sharded as the weights are (packed q|k|v and gate|up by output rows, o and down by
    input columns, their partial products summed with the layer's): tp 2 answers as tp 1, and otherwise than
    without the adapter."""
    save_adapter(tmp_path, random_adapter(tiny_qwen2, rank=4), str(tiny_qwen2))
    cold1, warm1, lp1, _ = run(tiny_qwen2, 1, span_adapter=str(tmp_path))
    cold2, warm2, lp2, reused = run(tiny_qwen2, 2, span_adapter=str(tmp_path))
    assert cold2 == warm2 == warm1 == cold1 and reused > 0
    assert lp2 == pytest.approx(lp1, abs=LOGPROB_ATOL)
    base = run(tiny_qwen2, 1)[0]
    assert base[:2] == cold1[:2] and base[2:] != cold1[2:]  # dense prompts on the base weights, span prompts not


def test_tp2_replicates_a_single_kv_head(tiny_model_root):
    path = build_tiny_model(tiny_model_root, "llama", name="llama_kv1", num_key_value_heads=1, vocab_size=385)
    assert_same(path)


def test_followers_stop_with_the_engine(tiny_llama):
    engine = Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=512, tp_size=2)
    followers = [f.process for f in engine._replica.followers]
    assert len(followers) == 1 and followers[0].is_alive()
    engine.generate("The quick brown fox", GREEDY)
    engine.shutdown()
    assert not followers[0].is_alive() and followers[0].exitcode == 0


def test_indivisible_heads_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="not divisible by tp_size 3"):
        Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=512, tp_size=3)


@pytest.mark.gpu
@pytest.mark.parametrize("tp_size", [2, 4])
def test_cuda_tp_matches_cpu_tp1(tiny_llama, tp_size):
    """NCCL, Triton and CUDA graphs captured with the all-reduces inside; tp 4 replicates the 2 KV heads."""
    if torch.cuda.device_count() < tp_size:
        pytest.skip(f"needs {tp_size} GPUs")
    assert_same(tiny_llama, tp_size, logprob_atol=1e-2, device="cuda", attention_backend="triton")
