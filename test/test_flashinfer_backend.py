"""The FlashInfer backend on CPU: its rows (indptr, indices, last-page lengths from req_to_token) for plain, span,
PDEP, recomputed-head and decode tokens, its refusals, and the engine through a torch double of FlashInfer's
documented semantics (flashinfer_double.py) against the torch_native backend."""

from __future__ import annotations

import types

import pytest
import torch
from flashinfer_double import FlashInferDouble

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import pdep, span
from sglang_pic.layers import flashinfer_backend
from sglang_pic.layers.flashinfer_backend import RopeParams, check_flashinfer_support
from sglang_pic.kernels.paged_layout import SpanScaling
from sglang_pic.layers.flashinfer_rows import decode_rows, extend_rows, span_groups, split_runs


def table(rows: int = 3, width: int = 16) -> torch.Tensor:
    """A request table whose slot for (row r, index j) is 100 * r + j, so indices read back as (row, index)."""
    return torch.arange(width).repeat(rows, 1) + 100 * torch.arange(rows)[:, None]


def test_a_request_is_cut_where_positions_jump_or_the_lowest_key_changes():
    # Request 0: prefix 0..2, a cached span at 3..5, an uncached span at 6..8 (sees from 6), PDEP 9..10.
    # Request 1: one riding decode at position 7. Request 2: a recomputed head 4..5 then PDEP 8 after its tail.
    positions = [0, 1, 2, 6, 7, 8, 9, 10, 7, 4, 5, 8]
    attn_lo = [0, 0, 0, 6, 6, 6, 0, 0, 0, 0, 0, 0]
    runs = split_runs(positions, attn_lo, [8, 1, 3])
    assert runs == ([0, 0, 0, 1, 2, 2], [0, 6, 0, 0, 0, 0], [3, 3, 2, 1, 2, 1], [2, 8, 10, 7, 5, 8])


def test_extend_rows_read_each_run_of_slots_in_logical_order():
    req_to_token = table()
    pool_rows = [2, 0]  # batch request 0 lives in table row 2, request 1 in row 0
    rows = extend_rows(req_to_token, pool_rows, [0, 1, 5, 6, 9, 3], [0, 0, 5, 5, 0, 0], [5, 1])
    assert rows.qo_indptr.tolist() == [0, 2, 4, 5, 6]
    assert rows.kv_indptr.tolist() == [0, 2, 4, 14, 18]
    slots = rows.kv_indices.tolist()
    assert slots[0:2] == [200, 201]  # prefix row
    assert slots[2:4] == [205, 206]  # the span row sees only the span: its keys start at index 0 of its list
    assert slots[4:14] == [200 + j for j in range(10)]  # PDEP sees the whole prompt, cached span included
    assert slots[14:18] == [0, 1, 2, 3]  # the other request's decode-like token
    assert rows.kv_last_page_len.tolist() == [1, 1, 1, 1] and rows.kv_indices.dtype == torch.int32
    assert not rows.one_query_per_row


def test_decode_rows_are_one_query_over_every_key():
    rows = decode_rows(table(), [1, 2], [3, 2])
    assert rows.one_query_per_row and rows.qo_indptr.tolist() == [0, 1, 2]
    assert rows.kv_indptr.tolist() == [0, 3, 5] and rows.kv_indices.tolist() == [100, 101, 102, 200, 201]


class Config:
    def __init__(self, rope_scaling=None, rope_theta=1e6) -> None:
        self.rope_scaling, self.rope_theta = rope_scaling, rope_theta


@pytest.mark.parametrize("seed", range(4))
def test_span_groups_split_each_querys_visible_keys(seed):
    """APE's masks against a query-by-query reading of their definition, for extend rows (several runs per request,
    one-query rows among them) and a decode batch; request 0's spans form two groups."""
    gen = torch.Generator().manual_seed(seed)
    ranges = [[(2, 6), (9, 12), (13, 14)], [(0, 5)], []]  # span key ranges of requests 0, 1, 2
    groups_of = [[0, 1, 0], [0], []]
    factors = {(0, 0): (0.5, 1.5), (0, 1): (2.0, 0.7), (1, 0): (0.8, 1.25)}  # (request, group): (T, S)
    flat = [r for rs in ranges for r in rs]
    pairs = [(b, g) for b, gs in enumerate(groups_of) for g in gs]
    scaling = SpanScaling(torch.tensor(flat).view(-1, 2), torch.tensor([0, 3, 4, 4]),
                          torch.tensor([g for _, g in pairs]), torch.tensor([factors[p][0] for p in pairs]),
                          torch.tensor([factors[p][1] for p in pairs]), 2)
    # request 0: queries 5-7 from 0 and 15 alone; request 1: 3-4 from lo 0 (inside its span), 8 alone; request 2: 0-4
    extend = extend_rows(table(), [0, 1, 2], [5, 6, 7, 15, 3, 4, 8, 0, 1, 2, 3, 4], [0] * 12, [4, 3, 5])
    decode = decode_rows(table(), [0, 1, 2], [int(n) for n in torch.randint(1, 17, (3,), generator=gen)])
    for rows in (extend, decode):
        groups = span_groups(rows, scaling)
        masks, rest, has = [[], []], [], [[], []]
        for r in range(rows.num_rows):
            b, lo = rows.row_req[r], rows.row_lo[r]
            n_q = int(rows.qo_indptr[r + 1] - rows.qo_indptr[r])
            n_kv = int(rows.kv_indptr[r + 1] - rows.kv_indptr[r])

            def group_of(index: int, b: int = b) -> int | None:
                return next((g for (a, e), g in zip(ranges[b], groups_of[b]) if a <= index < e), None)

            for i in range(n_q):
                query = lo + n_kv - n_q + i
                seen = [k <= n_kv - n_q + i for k in range(n_kv)]
                outside = group_of(query) is None
                for g in range(2):
                    row = [seen[k] and outside and group_of(lo + k) == g for k in range(n_kv)]
                    masks[g] += row
                    has[g].append(any(row))
                rest += [seen[k] and not (outside and group_of(lo + k) is not None) for k in range(n_kv)]
        assert groups.span_masks.tolist() == masks and groups.rest_mask.tolist() == rest
        assert groups.has_span.tolist() == has
        reqs = [rows.row_req[r] for r in range(rows.num_rows) for _ in range(int(rows.qo_indptr.diff()[r]))]
        for g in range(2):
            t_s = [factors.get((b, g), (1.0, 1.0)) for b in reqs]
            assert groups.temperature[g].tolist() == pytest.approx([t for t, _ in t_s])
            assert groups.weight[g].tolist() == pytest.approx([t * s for t, s in t_s])


def test_plain_and_linear_rope_are_supported():
    assert check_flashinfer_support(Config(), speculative=False) == RopeParams(1e6, 1.0)
    assert check_flashinfer_support(Config({"type": "linear", "factor": 4.0}), False) == RopeParams(1e6, 4.0)


@pytest.mark.parametrize("scaling", [{"rope_type": "llama3", "factor": 8.0}, {"rope_type": "yarn", "factor": 4.0}])
def test_rope_flashinfer_cannot_express_is_refused(scaling):
    with pytest.raises(ValueError, match=f"{scaling['rope_type']}.*use --attention-backend triton"):
        check_flashinfer_support(Config(scaling), speculative=False)


def test_speculative_decoding_is_refused():
    with pytest.raises(ValueError, match="VeriCache drafts"):
        check_flashinfer_support(Config(), speculative=True)


DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
    "In the morning we walked to the market and bought fresh bread and apples.",
]


def prompts() -> list[str]:
    """Plain text, isolated and anchored spans, recomputed heads, PDEP, spans at different offsets behind
    different prefixes, a prompt sharing a prefix with another, and spans with APE factors of their own."""
    q = pdep(" Question: what is said above? Answer:")
    return [
        "Once upon a time there was a small engine that",
        "System: answer briefly." + span(DOCS[0], anchor="none", head_tokens=0) + span(DOCS[1]) + q,
        "User two." + span(DOCS[1], anchor="none", head_tokens=0) + span(DOCS[0], head_tokens=3) + q,
        span(DOCS[2], anchor="prefix") + span(DOCS[0], anchor="none", head_tokens=0) + q,
        "Once upon a time there was a small engine that could",
        "Own factors." + span(DOCS[2], attention_temperature=0.5, attention_scale=1.8) + span(DOCS[1])
        + span(DOCS[0], attention_temperature=0.8) + q,
    ]


def run(model_path, backend: str, **kw) -> list[dict]:
    engine = Engine(model_path=str(model_path), dtype="float32", attention_backend=backend, max_total_tokens=4096,
                    **kw)
    try:
        params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        return engine.generate(prompts(), params, return_logprob=True)
    finally:
        engine.shutdown()


APE = {"span_attention_temperature": 0.6, "span_attention_scale": 1.4}


@pytest.mark.parametrize("settings", [{}, {"chunked_prefill_size": 16, "enable_mixed_chunk": True}, APE,
                                      {**APE, "chunked_prefill_size": 16, "enable_mixed_chunk": True}],
                         ids=["whole", "chunked+mixed", "ape", "ape+chunked+mixed"])
def test_the_engine_on_flashinfer_rows_matches_torch_native(tiny_qwen2, monkeypatch, settings):
    monkeypatch.setattr(flashinfer_backend, "FlashInferKernels", FlashInferDouble)
    FlashInferDouble.plans.clear()
    ours = run(tiny_qwen2, "flashinfer", **settings)
    plans = [rows for rows, _ in FlashInferDouble.plans]
    reference = run(tiny_qwen2, "torch_native", **settings)
    for got, want in zip(ours, reference):
        assert got["output_ids"] == want["output_ids"]
        lp = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
        ref = [t[0] for t in want["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(ref, abs=1e-4)
    # The rows the backend planned include span rows (keys from the span's start) and decode rows.
    assert any(p.one_query_per_row for p in plans)
    span_rows = [p for p in plans if not p.one_query_per_row and p.num_rows > 1]
    assert span_rows, "no extend planned several rows for one batch"
    if settings.get("span_attention_temperature"):  # the scaling changed what span prompts attend to
        plain = run(tiny_qwen2, "torch_native", **{k: v for k, v in settings.items() if k not in APE})
        assert any(a["meta_info"]["output_token_logprobs"] != b["meta_info"]["output_token_logprobs"]
                   for a, b in zip(ours, plain))


def test_the_engine_refuses_flashinfer_for_rope_it_cannot_express(tiny_llama, monkeypatch):
    monkeypatch.setattr(flashinfer_backend, "FlashInferKernels", FlashInferDouble)
    with pytest.raises(ValueError, match="'llama3' rope_scaling is not expressible"):
        Engine(model_path=str(tiny_llama), dtype="float32", attention_backend="flashinfer", max_total_tokens=1024)


def test_flashinfer_needs_cuda(tiny_qwen2):
    with pytest.raises(ValueError, match="runs on CUDA devices only"):
        Engine(model_path=str(tiny_qwen2), dtype="float32", attention_backend="flashinfer", max_total_tokens=1024)


def test_a_graph_replay_plans_the_live_decodes_and_the_padding_rows():
    """Before a decode graph of 4 replays 2 live requests, the plan holds their rows, then 2 padded requests that
    read the padding row's one key (the dummy slot), in the graph's fixed batch size."""
    from sglang_pic.forward_batch import ForwardMode
    from sglang_pic.layers.flashinfer_backend import FlashInferAttnBackend, HeadShape

    kernels = FlashInferDouble(HeadShape(4, 2, 8, 8, 1.0), RopeParams(1e4), torch.float32, torch.device("cpu"))
    backend = FlashInferAttnBackend(kernels)
    backend.init_cuda_graph_state(max_bs=4, max_request_keys=16)
    req_to_token = table(rows=4)  # row 3 is the padding row here
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=2, req_pool_indices_cpu=[1, 0], seq_lens_cpu=[3, 5],
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
    )
    FlashInferDouble.plans.clear()
    backend.init_forward_metadata_replay(batch, 4, padding_row=3)
    (rows, size), = FlashInferDouble.plans
    assert size == 4 and rows.kv_indptr.tolist() == [0, 3, 8, 9, 10]
    assert rows.kv_indices.tolist() == [100, 101, 102, 0, 1, 2, 3, 4, 300, 300]
