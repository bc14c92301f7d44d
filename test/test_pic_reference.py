"""Span semantics against a dense reference: HF transformers run with the explicit attention mask and positions.

The reference never touches the engine's attention code: it feeds the flattened prompt to the HF model with a 4D
boolean mask (span tokens see only earlier tokens of their own span, everything else sees all earlier tokens) and
position_ids = 0..L-1, then decodes greedily with full attention for generated tokens.
"""

from __future__ import annotations

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import pdep, span

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
    "In the morning we walked to the market and bought fresh bread and apples.",
]
NEW = 8


def flatten(engine: Engine, text: str) -> tuple[list[int], list[int]]:
    """Token ids and per-token lowest visible key, from the engine's own segmenter (tokenization only)."""
    req = engine.make_reqs(
        __import__("sglang_pic.managers.io_struct", fromlist=["GenerateReqInput"]).GenerateReqInput(text=text)
    )[0]
    ids, lo = [], []
    for seg in req.segments:
        ids.extend(seg.tokens)
        lo.extend([seg.start if seg.kind == "span" else 0] * len(seg.tokens))
    return ids, lo


def reference(model, ids: list[int], lo: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    ids, lo = list(ids), list(lo)
    out, logps = [], []
    for _ in range(n):
        L = len(ids)
        j = torch.arange(L)
        mask = (j[None, :] <= j[:, None]) & (j[None, :] >= torch.tensor(lo)[:, None])
        with torch.no_grad():
            logits = model(
                torch.tensor([ids]), attention_mask=mask[None, None], position_ids=j[None]
            ).logits[0, -1].float()
        tok = int(logits.argmax())
        logps.append(torch.log_softmax(logits, -1))
        out.append(tok)
        ids.append(tok)
        lo.append(0)
    return out, logps


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_llama, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    path = tiny_llama if request.param == "llama" else tiny_qwen2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=4096, page_size=4)
    yield engine, model
    engine.shutdown()


def prompts() -> list[str]:
    """The same spans at different offsets, behind different prefixes, in different orders."""
    return [
        "Answer the question." + span(DOCS[0]) + span(DOCS[1]) + "Where is Paris?",
        "You are a helpful assistant. Read carefully:" + span(DOCS[1]) + span(DOCS[2]) + span(DOCS[0]) + pdep("Why?"),
        span(DOCS[2]) + "What did we buy?",
    ]


def check(engine: Engine, model, texts: list[str], outs: list[dict]) -> None:
    for text, out in zip(texts, outs):
        ids, lo = flatten(engine, text)
        ref_tokens, ref_logps = reference(model, ids, lo, NEW)
        assert out["output_ids"] == ref_tokens
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        want = torch.stack([lp[t] for lp, t in zip(ref_logps, ref_tokens)])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_cold_then_cached_equal_dense_reference(setup):
    engine, model = setup
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    texts = prompts()
    cold = [engine.generate(t, params, return_logprob=True) for t in texts]
    check(engine, model, texts, cold)
    # Every span is cached now; the batch reuses them at new offsets behind new prefixes.
    warm = engine.generate(texts, params, return_logprob=True)
    check(engine, model, texts, warm)
    assert all(o["meta_info"]["cached_span_tokens"] > 0 for o in warm)


def test_same_span_in_one_batch_at_different_offsets(setup):
    engine, model = setup
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    texts = [
        "Short." + span(DOCS[0]) + "Where?",
        "A much longer preface that pushes the span further right in the request." + span(DOCS[0]) + "Where?",
        span(DOCS[1]) + span(DOCS[0]) + "Where?",
    ]
    outs = engine.generate(texts, params, return_logprob=True)
    check(engine, model, texts, outs)
    stats = engine.scheduler.stats
    # DOCS[0] is computed once for the three requests; the other two reuse its whole pages.
    doc_len = len(engine.tokenizer.encode(DOCS[0], add_special_tokens=False))
    assert sum(o["meta_info"]["cached_span_tokens"] for o in outs) >= 2 * (doc_len // 4 * 4)
    assert stats.span_segments >= 4
