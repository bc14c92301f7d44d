"""GPU: the engine on CUDA (Triton backend, CUDA graphs) gives the CPU float32 engine's greedy tokens."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from sglang_pic import Engine
from sglang_pic.forward_batch import ForwardMode
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little town by the sea where",
    "Preface." + span("The capital of France is Paris, the capital of Japan is Tokyo.") + "Where is Paris?",
    span("A serving engine batches requests.") + span("The capital of France is Paris, the capital of Japan is Tokyo.")
    + "Which one?",
]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@contextmanager
def no_device_syncs() -> Iterator[None]:
    """Any operation in the block that makes the host wait for the stream raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_engine_matches_cpu_float32(tiny_model, page_size):
    common = dict(model_path=str(tiny_model), dtype="float32", page_size=page_size, max_total_tokens=4096)
    with Engine(device="cpu", **common) as cpu:
        expected = [o["output_ids"] for o in cpu.generate(PROMPTS, GREEDY)]
    with Engine(device="cuda", attention_backend="triton", **common) as gpu:
        assert gpu.runner.graph_runner is not None
        got = [o["output_ids"] for o in gpu.generate(PROMPTS, GREEDY)]
        # again, with every span and prefix cached
        again = [o["output_ids"] for o in gpu.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert again == expected


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_on_cuda_matches_cpu(tiny_model, kv_cache_dtype):
    """An fp8 pool (calibrated scales, CUDA graphs, cached spans read again) gives the CPU engine's tokens on the
    same pool dtype."""
    common = dict(model_path=str(tiny_model), dtype="float32", max_total_tokens=4096, kv_cache_dtype=kv_cache_dtype)
    with Engine(device="cpu", **common) as cpu:
        expected = [o["output_ids"] for o in cpu.generate(PROMPTS, GREEDY)]
        cpu_scales = cpu.runner.token_to_kv_pool.k_scale, cpu.runner.token_to_kv_pool.v_scale
    with Engine(device="cuda", attention_backend="triton", **common) as gpu:
        pool = gpu.runner.token_to_kv_pool
        assert gpu.runner.graph_runner is not None and pool.k_buffer[0].element_size() == 1
        assert (pool.k_scale, pool.v_scale) == cpu_scales
        got = [o["output_ids"] for o in gpu.generate(PROMPTS, GREEDY)]
        again = [o["output_ids"] for o in gpu.generate(PROMPTS, GREEDY)]
    assert got == expected
    assert again == expected


SHARED_DOCS = [
    "Position-free keys are rotated inside attention, from each request's own positions, so one copy serves all.",
    "The capital of France is Paris, the capital of Japan is Tokyo, and the capital of Italy is Rome.",
]


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_decode_matches_cpu_float32_without_waiting_for_the_gpu(tiny_llama, page_size):
    """Requests holding the same cached spans at different offsets decode through the shared kernel (each span's
    KV read once per step): the CPU float32 engine's greedy tokens, and launching those steps never syncs."""
    prompts = [pre + span(SHARED_DOCS[i % 2]) + span(SHARED_DOCS[1 - i % 2]) + f"Question {i}?"
               for i, pre in enumerate(["Hi.", "A longer preface for this reader.", "x", "Read both, then answer."])]
    # Heads of 4 tokens (page 1; page 16 serves isolated spans): the default 64 covers these short documents whole.
    heads = {"span_head_tokens": 4} if page_size == 1 else {}
    common = dict(model_path=str(tiny_llama), dtype="float32", page_size=page_size, max_total_tokens=4096, **heads)
    with Engine(device="cpu", **common) as cpu:
        cpu.generate(prompts[:1], GREEDY)
        expected = [o["output_ids"] for o in cpu.generate(prompts, GREEDY)]
    with Engine(device="cuda", attention_backend="triton", **common) as gpu:
        # the tiny model's spans are far shorter than the runs a GPU shares by default
        gpu.scheduler.shared_decode = dataclasses.replace(gpu.scheduler.shared_decode, min_shared=8)
        gpu.generate(prompts[:1], GREEDY)  # caches both spans
        sched = gpu.scheduler
        launch = sched._launch

        def strict_launch(plan, last):
            with no_device_syncs():
                return launch(plan, last)

        sched._launch = strict_launch
        got = [o["output_ids"] for o in gpu.generate(prompts, GREEDY)]
        assert gpu.get_stats()["shared_decode_steps"] >= GREEDY["max_new_tokens"] // 2
        assert gpu.runner.graph_runner.num_shared_replays >= GREEDY["max_new_tokens"] // 2  # in their graphs
    assert got == expected


@pytest.mark.parametrize("page_size", [1, 16])
def test_admission_and_caching_never_wait_for_the_gpu(tiny_llama, page_size):
    """Matching a request's segments in the tree, allocating its slots, handing its computed KV to the tree and
    releasing it run on the host alone: a device sync there would make scheduling wait for every kernel queued."""
    fresh_doc = "Position-free keys are rotated inside attention, from each request's own positions."
    prompt = "Fresh words here." + span(fresh_doc) + PROMPTS[3]
    # Isolated spans (span_policy.py): the request computes its fresh span in its own row, the path checked here.
    with Engine(device="cuda", model_path=str(tiny_llama), dtype="float32", page_size=page_size,
                max_total_tokens=4096, span_anchor="none", span_head_tokens=0) as e:
        e.generate(PROMPTS, GREEDY)  # the shared spans are cached; the fresh one is not
        req = e.make_reqs(GenerateReqInput(text=prompt, sampling_params=GREEDY))[0]
        kv = e.scheduler.kv
        req.req_pool_idx = e.runner.req_to_token_pool.alloc()
        torch.cuda.synchronize()
        with no_device_syncs():
            kv.match(req)
            kv.alloc(req, [len(s.tokens) - s.done for s in req.segments])  # as if its prefill had run
            kv.cache(req)
            cached = [s.cached for s in req.segments]
            kv.release(req)  # frees its partial pages (page size 16) from the host record of its slots
        assert req.cached_span_tokens > 0
        assert cached == [len(s.tokens) // page_size * page_size for s in req.segments]


@pytest.mark.parametrize(
    "params,logprobs",
    [
        (GREEDY, {}),
        ({"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 16, "ignore_eos": True}, {}),
        (GREEDY, {"return_logprob": [True, False, True, True], "top_logprobs_num": [2, 0, 0, 3]}),
        (GREEDY, {"return_logprob": [True, False, True, True], "top_logprobs_num": [2, 0, 0, 3],
                  "logprob_start_len": [0, -1, 2, -1]}),
    ],
    ids=["greedy", "sampled", "logprobs", "prompt_logprobs"],
)
def test_launching_a_step_never_waits_for_the_gpu(tiny_llama, params, logprobs):
    """Launching a step (the batch, its decodes' inputs from the previous step's ids on the device, the forward,
    sampling, the copy of the new ids to the host, the computed spans handed to the tree) runs on the host alone:
    a sync there would wait for the step in flight and the overlap would be gone."""
    # Isolated spans: prompt logprobs over a span need it computed in the request's row (span_policy.py).
    with Engine(device="cuda", model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096,
                span_anchor="none", span_head_tokens=0) as e:
        sched = e.scheduler
        launch = sched._launch
        ahead = []

        def strict_launch(plan, last):
            ahead.append((last.step is not None, bool(plan.entries)))
            with no_device_syncs():
                return launch(plan, last)

        sched._launch = strict_launch
        outs = e.generate(PROMPTS, params, **logprobs)
        assert sum(a for a, _ in ahead) >= 10
        assert any(a and extends for a, extends in ahead)  # the waiting span prompts' extends ran ahead too
        assert all(len(o["output_ids"]) == 16 for o in outs)


def test_eviction_never_waits_for_the_gpu(tiny_llama):
    """The tree frees evicted slots from host copies taken at insertion: under a full pool every admission evicts,
    and a read of the slots from the device there would wait for the step in flight."""
    with Engine(device="cuda", model_path=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=1024) as e:
        e.generate([f"{p} variant {i}" for i in range(6) for p in PROMPTS], GREEDY)
        tree = e.scheduler.tree
        assert tree.evictable_size() > 0
        torch.cuda.synchronize()
        with no_device_syncs():
            freed = tree.evict(tree.evictable_size())
        assert freed > 0 and tree.evictable_size() == 0


def test_backup_to_the_host_tier_never_waits_for_the_gpu(tiny_llama):
    """With the hierarchical cache an evicted node's KV goes to host memory: the copies start without waiting for
    the stream (eviction runs at admission, beside the step in flight), and what comes back later is what went
    out, so greedy tokens equal a run that never evicted."""
    common = dict(device="cuda", model_path=str(tiny_llama), dtype="float32", page_size=4, max_total_tokens=4096)
    with Engine(**common) as roomy:
        expected = [o["output_ids"] for o in roomy.generate(PROMPTS, GREEDY)]
    with Engine(enable_hierarchical_cache=True, hicache_ratio=1.0, **common) as e:
        e.generate(PROMPTS, GREEDY)
        tree = e.scheduler.tree
        torch.cuda.synchronize()
        with no_device_syncs():
            moved = tree.evict(tree.evictable_size())
        assert moved > 0 and tree.host_size() == moved
        assert [o["output_ids"] for o in e.generate(PROMPTS, GREEDY)] == expected
        assert e.get_stats()["hicache_loaded_tokens"] > 0


def test_constrained_decoding_on_cuda_matches_cpu_float32(tiny_llama):
    """Grammar masks reach the CUDA logits (Triton's mask kernel) and pick the CPU engine's tokens."""
    from test_grammar import CONSTRAINED, check

    params = [{"temperature": 0, "max_new_tokens": 48, **c} for c in CONSTRAINED] + [GREEDY]
    prompts = (PROMPTS * 2)[: len(params)]
    common = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    with Engine(device="cpu", **common) as cpu:
        expected = [o["output_ids"] for o in cpu.generate(prompts, params)]
    with Engine(device="cuda", attention_backend="triton", **common) as gpu:
        outs = gpu.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == expected
    for c, out in zip(CONSTRAINED, outs):
        check(c, out["text"])


def test_one_request_extends_replay_graphs_with_cpu_float32_tokens(tiny_model):
    """Prompts sent one at a time are one-request extends: whole short prompts first, then (spans cached) a new
    prefix and a few tokens each. Both replay the extend graphs and keep the CPU float32 engine's tokens."""
    common = dict(model_path=str(tiny_model), dtype="float32", page_size=16, max_total_tokens=4096)
    later = ["Now: " + p for p in PROMPTS[2:]]
    with Engine(device="cpu", **common) as cpu:
        expected = [cpu.generate(p, GREEDY)["output_ids"] for p in PROMPTS + later]
    with Engine(device="cuda", attention_backend="triton", **common) as gpu:
        replays = gpu.runner.graph_runner.num_replays
        got = [gpu.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        first = replays[ForwardMode.EXTEND]
        got += [gpu.generate(p, GREEDY)["output_ids"] for p in later]
        cached = replays[ForwardMode.EXTEND] - first
    assert got == expected
    assert first >= len(PROMPTS) and cached == len(later)


# Seeded, so a request's noise comes from its own CPU generator and CUDA must pick what the CPU picks.
SAMPLED = [
    {"temperature": 0.8, "top_k": 20, "seed": 11},
    {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05, "seed": 12},
    {"temperature": 0.7, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3, "seed": 13},
    {"temperature": 0.9, "logit_bias": {"7": 3.0, "9": -100.0}, "seed": 14},
    {"temperature": 0.6, "min_new_tokens": 4, "stop": ["the"], "seed": 15},
]


def _sampled_outputs(engine: Engine) -> list[dict]:
    params = [dict(p, max_new_tokens=12, ignore_eos=True) for p in SAMPLED]
    prompts = (PROMPTS * len(params))[: len(params)]
    return engine.generate(prompts, params, return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)


# A span of several 16-token selection blocks (span_probe.SELECT_BLOCK): which blocks a request takes depends on the
# scores, while PROMPTS' spans of one or two blocks leave little to choose.
LONG_DOC = ("Paris sits on the Seine and is known for its museums. Tokyo is the largest city by population. Ottawa "
            "lies on the Ottawa River. Canberra was built as a capital. Brasilia was planned in the 1950s and opened "
            "in 1960.")
PROBED = [*PROMPTS[2:], "Preface." + span(LONG_DOC) + "Which city lies on a river named after it?",
          span(SHARED_DOCS[0]) + span(LONG_DOC) + "When did Brasilia open?"]


@pytest.mark.parametrize("select", ["query", "deviation"])
def test_probe_passes_on_cuda_choose_what_cpu_float32_chooses(tiny_llama, monkeypatch, select):
    """A probe pass alone in its step is an extend CUDA graphs could replay; it runs eagerly, so its layers score
    the question. A deviation pass is a scratch prefill through the first layers at admission. Either way the CUDA
    engine chooses the CPU engine's tokens, and answers alike."""
    from probe_choices import recording
    from sglang_pic.managers import span_probe

    common = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, span_head_tokens=2,
                  span_query_share=0.3, span_select=select)
    outs, choices, scores = {}, {}, {}
    for device in ("cpu", "cuda"):
        choices[device], scores[device] = [], []
        monkeypatch.setattr(span_probe, "choose", recording(choices[device], scores[device]))
        with Engine(device=device, **common) as engine:
            outs[device] = [engine.generate(p, GREEDY)["output_ids"] for p in PROBED]  # one at a time
    assert len(choices["cpu"]) == len(PROBED) == len(choices["cuda"])
    for i, (cpu, cuda) in enumerate(zip(scores["cpu"], scores["cuda"])):
        worst = int(np.argmax(np.abs(cuda - cpu)))
        assert np.allclose(cuda, cpu, rtol=1e-4, atol=1e-5), f"prompt {i}: position {worst} scores " \
            f"{cuda[worst]} on CUDA, {cpu[worst]} on CPU"
    assert choices["cuda"] == choices["cpu"]
    assert outs["cuda"] == outs["cpu"]


def test_cuda_sampling_matches_cpu_float32(tiny_llama):
    """Sampling on CUDA (filters, penalties, logit bias, stop strings, logprobs) picks the CPU float32 engine's
    tokens for seeded requests, and reports the same logprobs."""
    common = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    with Engine(device="cpu", **common) as cpu:
        expected = _sampled_outputs(cpu)
    with Engine(device="cuda", attention_backend="triton", **common) as gpu:
        got = _sampled_outputs(gpu)
    for want, have in zip(expected, got):
        assert have["output_ids"] == want["output_ids"]
        assert have["text"] == want["text"]
        assert have["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        for (lp_want, tok_want, _), (lp_have, tok_have, _) in zip(
            want["meta_info"]["output_token_logprobs"], have["meta_info"]["output_token_logprobs"]
        ):
            assert tok_have == tok_want and lp_have == pytest.approx(lp_want, abs=1e-4)


@pytest.mark.parametrize("full_kv", ["gpu", "host"])
@pytest.mark.parametrize("compressor", ["streaming", "snapkv", "kivi"])
def test_vericache_on_cuda_matches_cpu_float32(tiny_llama, compressor, full_kv):
    """Drafts over a hard-compressed cache and verification over the full KV (streamed from host memory for
    `host`), through the Triton backend, keep plain decoding's greedy tokens. Drafts replay CUDA graphs over the
    static draft tables (per-layer rows for snapkv with the full KV on the GPU; KIVI's fused kernel)."""
    common = dict(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096)
    prompts = [
        "Once upon a time there was a little town by the sea where fishermen told stories every night. " * 2,
        "def add(a, b): return a + b  # a tiny Python function that adds two numbers together " * 4,
    ]
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    with Engine(device="cpu", **common) as cpu:
        expected = [o["output_ids"] for o in cpu.generate(prompts, params)]
    spec = dict(
        speculative_algorithm="vericache",
        speculative_num_draft_tokens=8,
        vericache_compressor=compressor,
        vericache_budget=24,
        vericache_full_kv=full_kv,
    )
    with Engine(device="cuda", attention_backend="triton", **common, **spec) as gpu:
        got = [o["output_ids"] for o in gpu.generate(prompts, params)]
        worker = gpu.scheduler.spec_worker
        stats = worker.stats
        graphs = worker.draft_runner.graph_runner if worker.draft_runner is not None else None
        draft_replays = graphs.num_replays[ForwardMode.DECODE] if graphs is not None else 0
    assert got == expected
    assert 0 < stats.accepted_drafts < stats.draft_tokens
    assert draft_replays > 0


def test_kivi_pool_leaves_room_for_quantized_prefixes(tiny_llama):
    """Sized from free memory, the pool of a KIVI engine shrinks so that every token's 2-bit copy also fits."""
    from sglang_pic.speculative.compress_kivi import prefix_bytes_per_token

    common = dict(model_path=str(tiny_llama), device="cuda", attention_backend="triton", disable_cuda_graph=True,
                  mem_fraction_static=0.3)
    with Engine(**common) as plain:
        plain_tokens = plain.runner.max_total_num_tokens
        kv = plain.runner.token_to_kv_pool.bytes_per_token()
    del plain
    gc.collect()  # the first engine's pool must be free before the second one measures free memory
    with Engine(**common, speculative_algorithm="vericache", vericache_compressor="kivi") as kivi:
        kivi_tokens = kivi.runner.max_total_num_tokens
        cfg = kivi.model_config
        extra = prefix_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
    assert extra > 0 and kivi_tokens == pytest.approx(plain_tokens * kv / (kv + extra), rel=0.02)


def _compiled_attention_variants() -> int:
    """Variants Triton has compiled in this process for the kernels the engine's attention runs."""
    from sglang_pic.kernels import decode_attention, extend_attention, stage_keys, store_kv

    kernels = (
        extend_attention._extend_attention_kernel,
        extend_attention._extend_merge_kernel,
        decode_attention._decode_split_kernel,
        decode_attention._decode_merge_kernel,
        stage_keys._stage_keys_kernel,
        store_kv._store_kv_kernel,
    )
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


def _serve_varied_traffic(engine: Engine) -> None:
    """Batches of every kind the backend tells apart: long prompts (prefill tiles, staged keys, split key ranges),
    spans, short prompts decoding side by side, mixed steps, and extends of a few tokens behind a long cached
    prefix (few-query tiles, split)."""
    words = "the quick brown fox jumps over a lazy dog while seven sailors sing about distant harbours".split()
    long_doc = " ".join(words[i * 7 % len(words)] for i in range(780))
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    engine.generate([long_doc, *PROMPTS], params)
    engine.generate([long_doc + " Summarize.", long_doc + " Translate.", *[p + " Why?" for p in PROMPTS]], params)
    for p in (long_doc + " One more.", "Preface." + span(long_doc[:3000]) + "Short?"):
        engine.generate(p, params)


def test_kernel_warm_up_leaves_nothing_to_compile(tiny_model_root):
    """After the startup warm-up, serving traffic of every batch kind compiles no attention kernel variant. The
    control engine skips the warm-up and compiles variants on the same traffic (float16, which no other test
    compiles; the warmed engine runs bfloat16)."""
    from tiny_models import build_tiny_model

    path = build_tiny_model(tiny_model_root, "llama", name="llama_4k", max_position_embeddings=4096)
    common = dict(model_path=str(path), device="cuda", attention_backend="triton", disable_cuda_graph=True,
                  max_total_tokens=16384)
    with Engine(dtype="float16", skip_kernel_warmup=True, **common) as cold:
        start = _compiled_attention_variants()
        _serve_varied_traffic(cold)
        compiled_cold = _compiled_attention_variants() - start
    gc.collect()
    with Engine(dtype="bfloat16", **common) as warm:
        start = _compiled_attention_variants()
        _serve_varied_traffic(warm)
        compiled_warm = _compiled_attention_variants() - start
    assert compiled_cold >= 6
    assert compiled_warm == 0


def test_shutdown_gives_the_device_memory_back(tiny_llama):
    """Engines one after another in one process, each sizing its KV pool from the free memory: a shut-down engine
    that is still referenced (as after `with Engine(...) as e`) holds no device memory."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(2):
        with Engine(device="cuda", model_path=str(tiny_llama), dtype="float32") as engine:
            assert engine.generate("Hi", GREEDY)["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
            assert torch.cuda.memory_allocated() - base > 2**30  # its KV pool takes most of the device
        assert torch.cuda.memory_allocated() - base < 64 * 2**20, "a shut-down engine kept device memory"
        assert engine.get_stats()["generation_tokens"] == GREEDY["max_new_tokens"]
