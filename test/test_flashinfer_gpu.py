"""GPU: the FlashInfer backend against the Triton backend on a tiny model, in bf16 (FlashInfer's kernels take no
float32): prompt logprobs through isolated spans and PDEP, and the logprobs of the greedy tokens through anchored
spans, recomputed heads and a probe pass (span query shares), agree within the difference between two of our own
backends (torch_native and Triton), plain and under APE's span attention scaling (FlashInfer's two masked passes);
plain decode steps replay FlashInfer's graph-mode decode."""

from __future__ import annotations

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.forward_batch import ForwardMode
from sglang_pic.frontend_lang.markers import pdep, span

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
flashinfer = pytest.importorskip("flashinfer")

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo, and the capital of Italy is Rome.",
    "A serving engine batches requests and streams tokens back to each client as they are produced.",
]
ISOLATED = [  # prompt logprobs may cover these spans: the request computes or reads exactly their own KV
    "Once upon a time there was a little town by the sea where",
    "System." + span(DOCS[0], anchor="none", head_tokens=0) + span(DOCS[1], anchor="none", head_tokens=0)
    + pdep(" Question: which city?"),
]
ANCHORED = [  # spans served from span jobs (anchor, recomputed head): compared on their outputs
    "System." + span(DOCS[0], anchor="none", head_tokens=0) + span(DOCS[1]) + pdep(" Question: which city?"),
    "Other." + span(DOCS[1], anchor="none", head_tokens=0) + span(DOCS[0], head_tokens=4) + pdep(" Answer:"),
    "Probe." + span(DOCS[0], query_share=0.3) + span(DOCS[1], query_share=0.3) + pdep(" Which city?"),
]
PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def qwen2_d64(tiny_model_root):
    """A tiny Qwen2 with 64-wide heads: FlashInfer's kernels start at head_dim 64 (the tiny models use 16)."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tiny_model_root, "qwen2", name="qwen2-d64", head_dim=64)


def run(model, backend: str, **settings) -> tuple[list[list[float]], list[dict], dict]:
    """(prompt logprobs of the isolated prompts, outputs of the anchored ones, graph replays by mode)."""
    with Engine(model_path=str(model), dtype="bfloat16", device="cuda", attention_backend=backend,
                max_total_tokens=8192, **settings) as engine:
        isolated = engine.generate(ISOLATED, PARAMS, return_logprob=True, logprob_start_len=0)
        anchored = engine.generate(ANCHORED, PARAMS, return_logprob=True)
        runner = engine.runner.graph_runner
        replays = dict(runner.num_replays) if runner is not None else {}
    prompt_lp = [[t[0] for t in o["meta_info"]["input_token_logprobs"][1:]] for o in isolated]
    return prompt_lp, anchored, replays


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def greedy_logprobs(a: list[dict], b: list[dict]) -> tuple[list[list[float]], list[list[float]]]:
    """Each output's token logprobs up to where the two runs' greedy tokens part (bf16 ties may part them)."""
    out_a, out_b = [], []
    for x, y in zip(a, b):
        same = next((i for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])) if s != t),
                    len(x["output_ids"]))
        same = max(same, 1)  # the first token's logprob is compared even when the first tokens differ
        out_a.append([t[0] for t in x["meta_info"]["output_token_logprobs"][:same]])
        out_b.append([t[0] for t in y["meta_info"]["output_token_logprobs"][:same]])
    return out_a, out_b


@pytest.mark.parametrize("settings", [{}, {"span_attention_temperature": 0.6, "span_attention_scale": 1.4}],
                         ids=["plain", "ape"])
def test_flashinfer_matches_triton_within_bf16_tolerance(qwen2_d64, settings):
    fi_lp, fi_out, fi_replays = run(qwen2_d64, "flashinfer", **settings)
    tr_lp, tr_out, _ = run(qwen2_d64, "triton", **settings)
    tn_lp, tn_out, _ = run(qwen2_d64, "torch_native", **settings)
    ours = max_diff(tn_lp, tr_lp)  # how far two of our own bf16 backends are apart
    theirs = max_diff(fi_lp, tr_lp)
    ours_out = max_diff(*greedy_logprobs(tn_out, tr_out))
    theirs_out = max_diff(*greedy_logprobs(fi_out, tr_out))
    equal = sum(a["output_ids"] == b["output_ids"] for a, b in zip(fi_out, tr_out))
    print(f"prompt logprobs max |diff|: flashinfer-triton {theirs:.4f}, torch_native-triton {ours:.4f}; output "
          f"logprobs: {theirs_out:.4f} vs {ours_out:.4f}; greedy outputs equal {equal}/{len(fi_out)}")
    assert theirs <= max(2 * ours, 0.05)
    assert theirs_out <= max(2 * ours_out, 0.05)
    assert fi_replays.get(ForwardMode.EXTEND, 0) == 0  # extends are planned per batch, never captured
    if not settings:
        assert fi_replays.get(ForwardMode.DECODE, 0) > 0  # decode steps ran FlashInfer's decode in CUDA graphs
    else:  # the scaling moved the prompt logprobs beyond bf16 noise
        plain_lp = run(qwen2_d64, "flashinfer")[0]
        assert max_diff(fi_lp, plain_lp) > 2 * max(ours, theirs)


def test_flashinfer_refuses_speculative_decoding(tiny_qwen2):
    with pytest.raises(ValueError, match="VeriCache drafts"):
        Engine(model_path=str(tiny_qwen2), dtype="bfloat16", device="cuda", attention_backend="flashinfer",
               speculative_algorithm="vericache", max_total_tokens=4096)
