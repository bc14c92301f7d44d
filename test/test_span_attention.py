"""APE's query-time scaling of span attention (span_attention_temperature / span_attention_scale) against a dense
reference, and its settings.

The reference is test_span_policy's flat sequence run through the HF model with an attention function of its own:
a query outside every span (prefix, PDEP text, recomputed tokens, output) sees the visible tokens of the spans with
equal factors (T, S) as one group, normalized on its own with logits divided by T and weighted by exp(S * T * LSE)
against the other groups and the other visible keys, each normalized on its own; a span's own tokens attend plainly.
It shares nothing with the engine's kernels.
"""

from __future__ import annotations

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.server_args import ServerArgs
from test_span_policy import DOCS, PARAMS, assert_answers_as, cold_then_warm, prompts, reference, segments_layout

TEMPERATURE, SCALE = 0.6, 1.4
POLICIES = {  # name -> (span_anchor, span_head_tokens)
    "isolated": ("none", 0),
    "anchor+head": ("auto", 3),
}
REFERENCE_ATTENTION = "sglang_pic_span_groups_reference"


class SpanGroups:
    """What the reference attention needs about the flat sequence it runs: each prompt token's span factors (T, S),
    None for a token of no span (the tokens it appends are the request's own)."""

    factors: list[tuple[float, float] | None] = []


def _grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The reference's attention (see the module doc); the mask is the layout's boolean visibility."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1).double(), value.repeat_interleave(group, dim=1).double()
    scores = torch.matmul(query.double(), key.transpose(2, 3)) * scaling  # [1, H, L, L]
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1.0
    factors = SpanGroups.factors + [None] * (key.shape[2] - len(SpanGroups.factors))
    in_span = torch.tensor([f is not None for f in factors])
    out = torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), value)
    lses, outs = [], []
    for temp, scale in sorted({f for f in factors if f is not None}):
        keys = visible & torch.tensor([f == (temp, scale) for f in factors])[None, None, None, :]
        tempered = (scores / temp).masked_fill(~keys, float("-inf"))
        lses.append(scale * temp * torch.logsumexp(tempered, -1))
        outs.append(torch.matmul(torch.softmax(tempered, -1).nan_to_num(0.0), value))
    other = scores.masked_fill(~(visible & ~in_span[None, None, None, :]), float("-inf"))
    lses.append(torch.logsumexp(other, -1))
    outs.append(torch.matmul(torch.softmax(other, -1).nan_to_num(0.0), value))
    weights = torch.softmax(torch.stack(lses), 0).nan_to_num(0.0)
    merged = sum(w[..., None] * o for w, o in zip(weights, outs))
    rows = ~in_span[None, None, :, None]
    out = torch.where(rows, merged, out)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


@pytest.fixture(scope="module")
def setup(tiny_llama):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(REFERENCE_ATTENTION, _grouped_attention)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation=REFERENCE_ATTENTION)
    engine = Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    yield engine, model.eval()
    engine.shutdown()


def grouped_reference(model, segments) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and log-probabilities of the reference for a request's segments (each span piece carries its
    factors)."""
    flat = segments_layout(segments)
    SpanGroups.factors = [None if s is None else segments[s].attention for s in flat.scope]
    return reference(model, flat, PARAMS["max_new_tokens"])


def check(engine: Engine, model, texts: list[str], outs: list[dict], given: dict) -> None:
    for text, out in zip(texts, outs):
        segments = engine.make_reqs(GenerateReqInput(text=text, **given))[0].segments
        assert_answers_as(out, *grouped_reference(model, segments))


@pytest.mark.parametrize("policy", list(POLICIES))
def test_scaled_span_attention_equals_grouped_reference(setup, policy):
    """Cold one by one, then warm in one batch (spans at new offsets, prefills beside decodes)."""
    engine, model = setup
    anchor, head = POLICIES[policy]
    given = {"span_anchor": anchor, "span_head_tokens": head,
             "span_attention_temperature": TEMPERATURE, "span_attention_scale": SCALE}
    texts = prompts()
    cold_then_warm(engine, texts, given, lambda outs: check(engine, model, texts, outs, given))


def test_unit_factors_are_plain_attention(setup):
    """T = S = 1 is no scaling at all; other factors change what the model says."""
    engine, _ = setup
    texts = prompts()
    engine.flush_cache()
    plain = engine.generate(texts, PARAMS, return_logprob=True)
    engine.flush_cache()  # both cold: a cache hit may round differently from the prefill that computed it
    unit = engine.generate(texts, PARAMS, return_logprob=True, span_attention_temperature=1.0,
                           span_attention_scale=1.0)
    assert [o["meta_info"]["output_token_logprobs"] for o in unit] == \
        [o["meta_info"]["output_token_logprobs"] for o in plain]
    scaled = engine.generate(texts, PARAMS, return_logprob=True, span_attention_temperature=0.3,
                             span_attention_scale=3.0)
    assert [o["meta_info"]["output_token_logprobs"] for o in scaled] != \
        [o["meta_info"]["output_token_logprobs"] for o in plain]


def test_text_after_spans_is_cached_under_the_factors_it_read_them_with(setup):
    """The text after a span (its recomputed head, PDEP text, the question) attends to the span as the factors say,
    so a request with other factors never hits that KV: warm after a plain run of the same prompt, it answers as
    it does cold; the spans' own KV, which no factor changes, is still shared."""
    engine, _ = setup
    given = {"span_anchor": "auto", "span_head_tokens": 1}
    ape = {**given, "span_attention_temperature": 0.3, "span_attention_scale": 3.0}
    text = prompts()[0]
    engine.flush_cache()
    cold = engine.generate(text, PARAMS, return_logprob=True, **ape)
    engine.flush_cache()
    engine.generate(text, PARAMS, **given)
    warm = engine.generate(text, PARAMS, return_logprob=True, **ape)
    assert warm["meta_info"]["cached_span_tokens"] > 0
    assert warm["output_ids"] == cold["output_ids"]
    lp = [t[0] for t in warm["meta_info"]["output_token_logprobs"]]
    assert lp == pytest.approx([t[0] for t in cold["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_at_most_four_span_groups(setup):
    engine, _ = setup
    isolated = {"span_anchor": "none", "span_head_tokens": 0}  # short spans a head would recompute whole
    for n in (5, 4):
        text = "Q:" + "".join(span(DOCS[i % 3] + f" {i}.", attention_temperature=0.5 + 0.1 * i) for i in range(n))
        if n > 4:
            with pytest.raises(ValueError, match="5 distinct .* at most 4"):
                engine.generate(text + "?", PARAMS, **isolated)
        else:
            assert engine.generate(text + "?", PARAMS, **isolated)["meta_info"]["finish_reason"] is not None


@pytest.mark.parametrize("value", [0, -1.0, 17.0, "1", True])
def test_bad_factors_are_refused(setup, value):
    engine, _ = setup
    for name in ("span_attention_temperature", "span_attention_scale"):
        with pytest.raises(ValueError, match=name):
            engine.generate(prompts()[0], PARAMS, **{name: value})


@pytest.mark.parametrize("policy", list(POLICIES))
def test_spans_with_their_own_factors_form_groups(setup, policy):
    """A span's own factors over the request's: three groups (two spans' own, the request's for the third) and a span
    read plainly, cold one by one, then warm in one batch."""
    engine, model = setup
    anchor, head = POLICIES[policy]
    given = {"span_anchor": anchor, "span_head_tokens": head,
             "span_attention_temperature": TEMPERATURE, "span_attention_scale": SCALE}
    texts = [f"Case {i}: " + span(DOCS[i % 3], attention_temperature=0.5, attention_scale=1.8)
             + span(DOCS[(i + 1) % 3]) + span(DOCS[(i + 2) % 3], attention_temperature=0.8)
             + span(DOCS[i % 3][::-1], attention_temperature=1.0, attention_scale=1.0) + "Which one?"
             for i in range(3)]
    groups = {p for seg in engine.make_reqs(GenerateReqInput(text=texts[0], **given))[0].segments
              if seg.kind == "span" for p in [seg.attention]}
    assert groups == {(0.5, 1.8), (TEMPERATURE, SCALE), (0.8, SCALE), (1.0, 1.0)}
    cold_then_warm(engine, texts, given, lambda outs: check(engine, model, texts, outs, given))


def test_speculative_decoding_refuses_the_scaling():
    with pytest.raises(ValueError, match="speculative"):
        ServerArgs(model_path="m", speculative_algorithm="vericache", span_attention_scale=1.2)
