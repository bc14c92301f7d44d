"""--kv-cache-dtype: an fp8 pool on the CPU path (torch_native): its calibrated scales, its bytes, cache hits that
equal recomputation under the same pool dtype, spans read back from the host tier, and the combinations refused.
The Triton kernels on fp8 pools are in test_kernels_triton.py."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import pdep, span
from sglang_pic.kv_cache_dtype import kv_storage_dtype, to_kv_dtype
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool
from sglang_pic.server_args import ServerArgs

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo, the capital of Peru is Lima.",
    "A serving engine batches requests and streams tokens back to each client as they come.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_names_resolve_and_fp8_saturates_instead_of_overflowing():
    assert kv_storage_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_storage_dtype("bf16", torch.float32) is torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    x = torch.tensor([1000.0, -1000.0, 1.1, 0.0])  # e4m3 steps by 1/8 in [1, 2)
    assert to_kv_dtype(x, torch.float8_e4m3fn).float().tolist() == [448.0, -448.0, 1.125, 0.0]
    assert to_kv_dtype(x * 100, torch.float8_e5m2).float().tolist()[:2] == [57344.0, -57344.0]


def test_calibration_fixes_power_of_two_scales_per_layer():
    """Small values (Qwen2.5-0.5B's first-layer values are about 0.03) are stored scaled up out of e4m3's
    subnormals, large keys scaled down below its largest value; a bf16 pool keeps 1.0."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 1, 4, 2, "cpu")
    pool.start_calibration()
    pool.to_storage(0, torch.full((3, 4), 200.0), torch.full((3, 4), -0.03))
    pool.to_storage(1, torch.ones(3, 4), torch.ones(3, 4))
    pool.to_storage(1, torch.full((3, 4), 3.0), torch.zeros(3, 4))
    pool.finish_calibration()
    assert pool.k_scale == [1.0, 2.0**-6] and pool.v_scale == [2.0**-12, 2.0**-7]
    k, v = pool.to_storage(0, torch.full((1, 4), 200.0), torch.full((1, 4), 0.03))
    assert torch.equal(k, torch.full((1, 4), 200.0)) and torch.equal(v, torch.full((1, 4), 0.03 * 2**12))
    assert pool.calibration is None
    plain = MHATokenToKVPool(16, 1, torch.bfloat16, 1, 4, 2, "cpu")
    plain.start_calibration()
    plain.to_storage(0, torch.full((3, 4), 1e-3), torch.full((3, 4), 1e4))
    plain.finish_calibration()
    assert plain.k_scale == [1.0, 1.0] and plain.v_scale == [1.0, 1.0]


def test_fp8_pool_takes_a_quarter_of_fp32_bytes_and_is_reported(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=1024) as full:
        full_bytes = full.runner.token_to_kv_pool.bytes_per_token()
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=1024, kv_cache_dtype="fp8_e4m3") as e:
        pool = e.runner.token_to_kv_pool
        assert pool.k_buffer[0].dtype is torch.float8_e4m3fn and pool.v_buffer[0].dtype is torch.float8_e4m3fn
        assert pool.bytes_per_token() * 4 == full_bytes
        scales = pool.k_scale + pool.v_scale  # calibrated at start: powers of two, not all 1
        assert any(x != 1.0 for x in scales) and all(math.log2(x).is_integer() for x in scales)
        assert e.get_server_info()["kv_cache_dtype"] == "fp8_e4m3"
        out = e.generate("Once upon a time", GREEDY)
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


# Heads shorter than the spans (the default recomputes these short spans whole), so the tails are reused; then
# the selection passes, APE's reweighting and small pages with chunked prefill on the same pool.
SPAN_SETTINGS = {
    "heads": dict(span_head_tokens=4),
    "query_probe": dict(span_head_tokens=2, span_query_share=0.3),
    "deviation": dict(span_head_tokens=2, span_query_share=0.3, span_select="deviation"),
    "ape": dict(span_head_tokens=4, span_attention_temperature=0.8, span_attention_scale=1.1),
    "pages16_chunked": dict(span_anchor="none", span_head_tokens=0, page_size=16, chunked_prefill_size=32),
}


@pytest.mark.parametrize("setting", list(SPAN_SETTINGS))
def test_fp8_cache_hits_equal_recomputation(tiny_llama, setting):
    """Cached spans behind new prefixes at new offsets, and a cached prefix, give the tokens a cold engine with the
    same fp8 pool computes: keys are rounded once, unrotated, so every offset reads the same bytes."""
    prompts = [pre + span(DOCS[i % 2]) + span(DOCS[1 - i % 2]) + pdep(f"Question {i}?")
               for i, pre in enumerate(["Read.", "Please read both documents carefully.", "Hi"])]
    settings = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, kv_cache_dtype="fp8_e4m3",
                    **SPAN_SETTINGS[setting])
    cold = []
    for p in prompts:
        with Engine(**settings) as e:
            cold.append(e.generate(p, GREEDY)["output_ids"])
    with Engine(**settings) as warm:
        warm.generate(prompts[0], GREEDY)
        outs = [warm.generate(p, GREEDY) for p in prompts]
        assert [o["output_ids"] for o in outs] == cold
        assert all(o["meta_info"]["cached_span_tokens"] > 0 for o in outs)
        if setting == "heads":  # the repeated prompt hits whole (a probe's picks and partial pages are not cached)
            assert outs[0]["meta_info"]["cached_tokens"] == outs[0]["meta_info"]["prompt_tokens"] - 1


def test_fp8_spans_come_back_from_the_host(tiny_llama):
    """Spans evicted from a small fp8 pool wait in host memory in fp8 and come back with the roomy run's tokens."""
    docs = [f"Report {i}: the harbour of town {i} shipped {i * 7} crates of salt and wool north." for i in range(6)]
    prompts = [f"Question {i}." + span(docs[i]) + span(docs[i + 3]) + "Answer:" for i in range(3)]
    settings = dict(model_path=str(tiny_llama), dtype="float32", kv_cache_dtype="fp8_e5m2", span_anchor="none",
                    span_head_tokens=0)
    with Engine(max_total_tokens=4096, **settings) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(prompts, GREEDY)]
    with Engine(max_total_tokens=160, page_size=4, enable_hierarchical_cache=True, hicache_ratio=4.0,
                **settings) as engine:
        engine.warm_spans(docs)
        assert engine.get_stats()["hicache_host_tokens"] > 0
        assert [engine.generate(p, GREEDY)["output_ids"] for p in prompts] == expected
        assert engine.get_stats()["hicache_loaded_tokens"] > 0


@pytest.mark.parametrize("kw, problem", [
    (dict(kv_cache_dtype="fp4_e2m1"), "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="fp8_e4m3", attention_backend="flashinfer"), "flashinfer"),
    (dict(kv_cache_dtype="fp8_e5m2", speculative_algorithm="vericache"), "speculative"),
])
def test_unsupported_kv_cache_dtypes_are_refused_by_name(kw, problem):
    with pytest.raises(ValueError, match=problem):
        ServerArgs(**kw)
