"""The Triton interpreter cases that run whole engines over the tiny llama (see triton_cases.py, which serves them
with the kernel cases): KIVI drafting through its fused kernel, shared decode, APE, the probe pass, fp8 KV pools
and CUDA-graph replays (emulated) in the engine.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Callable


@functools.cache
def tiny_llama() -> Path:
    """The tiny llama checkpoint the engine cases share, built once per worker."""
    from tiny_models import build_tiny_model

    return build_tiny_model(Path(tempfile.mkdtemp()), "llama")


def kivi_engine_case() -> dict:
    """VeriCache KIVI through the Triton backend in the engine: drafts over the static draft tables (the tables
    CUDA graphs replay), the fused kernel, refreshes from the draft rows; greedy tokens equal plain decoding's."""
    from sglang_pic.engine import Engine

    common = dict(model_path=str(tiny_llama()), dtype="float32", max_total_tokens=2048, device="cpu")
    prompt = "Once upon a time there was a little town by the sea where fishermen told stories every night. " * 2
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(**common) as plain:
        expected = plain.generate(prompt, params)["output_ids"]
    # 94 prompt tokens: 64 quantized and 30 exact rows, moved into the prefix again once they reach 8 + 32 (after
    # 10 new tokens)
    spec = dict(speculative_algorithm="vericache", speculative_num_draft_tokens=8, vericache_compressor="kivi",
                vericache_budget=8)
    with Engine(attention_backend="triton", **common, **spec) as e:
        got = e.generate(prompt, params)["output_ids"]
        worker = e.scheduler.spec_worker
        return {
            "dtype": "float32",
            "nan": False,
            "identical": got == expected,
            "static_kivi_backend": type(worker.draft_runner.backend).__name__,
            "refreshed": worker.stats.draft_builds > 1,
            "drafts_accepted_and_rejected": 0 < worker.stats.accepted_drafts < worker.stats.draft_tokens,
        }


def _engine_outputs(backends: dict[str, dict], prompts: list[str]) -> tuple[dict, dict]:
    """Greedy output ids and stats of each named engine configuration over the tiny llama: a first one-token
    request caches the prompts[0] text (its spans, or its whole prefix), so the batch of all prompts finds it."""
    from sglang_pic.engine import Engine

    # Span heads shorter than the spans: the shared kernel reads the span tails after the requests' own heads.
    common = dict(model_path=str(tiny_llama()), dtype="float32", max_total_tokens=2048, device="cpu",
                  span_head_tokens=4)
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    outs, stats = {}, {}
    for name, kw in backends.items():
        with Engine(**common, **kw) as e:
            e.generate(prompts[:1], {**params, "max_new_tokens": 1})
            outs[name] = [o["output_ids"] for o in e.generate(prompts, params)]
            stats[name] = e.get_stats()
    return outs, stats


def _span_prompts() -> list[str]:
    """Requests holding the same two cached spans at different offsets (other prefaces, the spans swapped)."""
    from sglang_pic.frontend_lang.markers import pdep, span

    docs = ["The capital of France is Paris, the capital of Japan is Tokyo. " * 2,
            "A serving engine batches requests and streams tokens back to each client. " * 2]
    prefaces = ["Read.", "Please read these two documents carefully.", "Hi", "Another preface, a longer one."]
    return [pre + span(docs[i % 2]) + span(docs[1 - i % 2]) + pdep(f"Question {i}?") for i, pre in enumerate(prefaces)]


def shared_decode_engine_case() -> dict:
    """Requests holding the same cached spans at different offsets decode through the shared kernel in the
    engine (Triton backend); greedy tokens equal torch_native's and the per-request kernel's."""
    outs, stats = _engine_outputs(
        {"torch_native": {}, "shared": dict(attention_backend="triton"),
         "per_request": dict(attention_backend="triton", disable_shared_decode=True)},
        _span_prompts(),
    )
    return {
        "dtype": "float32",
        "nan": False,
        "identical": outs["shared"] == outs["torch_native"] == outs["per_request"],
        "shared_steps": stats["shared"]["shared_decode_steps"],
        "keys_saved": stats["shared"]["decode_keys_saved"],
        "per_request_shared_steps": stats["per_request"]["shared_decode_steps"],
    }


def shared_decode_common_prefix_engine_case() -> dict:
    """No markers: a common system prompt before different questions is one tree node all of them hold, and
    their decodes share it through the shared kernel."""
    system = "You answer questions about the sea, the town by it and the fishermen who live there. " * 2
    prompts = [system + q for q in ("Who fishes?", "Where is the town?", "When do the boats leave in the morning?")]
    outs, stats = _engine_outputs({"torch_native": {}, "shared": dict(attention_backend="triton")}, prompts)
    return {
        "dtype": "float32",
        "nan": False,
        "identical": outs["shared"] == outs["torch_native"],
        "shared_steps": stats["shared"]["shared_decode_steps"],
    }


def span_probe_engine_case() -> dict:
    """The probe pass (span_query_share) through the Triton backend: its requests choose the tokens torch_native's
    choose (the probe scores beside whichever kernel), and answer alike."""
    from probe_choices import CHOOSE, recording
    from sglang_pic.engine import Engine
    from sglang_pic.managers import span_probe

    choices: dict[str, list] = {}
    common = dict(model_path=str(tiny_llama()), dtype="float32", max_total_tokens=2048, device="cpu",
                  span_head_tokens=2, span_query_share=0.25)
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    outs = {}
    for name, kw in {"torch_native": {}, "triton": dict(attention_backend="triton")}.items():
        choices[name] = []
        span_probe.choose = recording(choices[name])
        try:
            with Engine(**common, **kw) as e:
                outs[name] = [o["output_ids"] for o in e.generate(_span_prompts(), params)]
        finally:
            span_probe.choose = CHOOSE
    return {
        "dtype": "float32",
        "nan": False,
        "probed": len(choices["triton"]),
        "same_choice": sorted(map(repr, choices["triton"])) == sorted(map(repr, choices["torch_native"])),
        "identical": outs["triton"] == outs["torch_native"],
    }


def span_attention_engine_case() -> dict:
    """APE's span scaling (server flags, and spans with factors of their own: several groups in a request) through
    the Triton backend with tensor parallelism 2 (each rank's kernel over half the heads): greedy tokens equal
    torch_native's, and differ from plain attention's."""
    from sglang_pic.frontend_lang.markers import pdep, span

    ape = dict(span_attention_temperature=0.6, span_attention_scale=1.4)
    own = [span("Tokyo is large. " * 4, attention_temperature=0.5, attention_scale=1.8) + span("Lima is far. " * 4)
           + span("Oslo is cold. " * 4, attention_temperature=0.8) + pdep("Which city?")]
    outs, _ = _engine_outputs(
        {"torch_native": ape, "tp2": dict(attention_backend="triton", tp_size=2, **ape), "plain": {}},
        _span_prompts() + own,
    )
    return {
        "dtype": "float32",
        "nan": False,
        "identical": outs["tp2"] == outs["torch_native"],
        "scaled": outs["torch_native"] != outs["plain"],
    }


def fp8_kv_engine_case() -> dict:
    """An fp8 KV pool (--kv-cache-dtype fp8_e4m3) through the Triton backend with tensor parallelism 2, whose
    follower receives the shared decode plan: the kernels read the bytes torch_native reads, so greedy tokens equal
    torch_native's on the same pool dtype."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    outs, stats = _engine_outputs(
        {"torch_native": fp8, "tp2": dict(attention_backend="triton", tp_size=2, **fp8)},
        _span_prompts(),
    )
    return {
        "dtype": "float32",
        "nan": False,
        "identical": outs["tp2"] == outs["torch_native"],
        "shared_steps": stats["tp2"]["shared_decode_steps"],
    }


def graph_replay_engine_case() -> dict:
    """Decodes and one-request extends replayed as their CUDA graphs would be (graph_replay.py) through the Triton
    backend give the eager engine's tokens (torch_native's, which the eager Triton engine gives in the other cases):
    spans with a probe pass (recomputed tokens scattered through them) and an extend behind a cached prefix that
    pads to the tiny model's whole context, whose keys the graph must stage."""
    from graph_replay import EmulatedGraphs
    from test_gpu_engine import PROBED
    from sglang_pic.engine import Engine

    common = dict(model_path=str(tiny_llama()), dtype="float32", max_total_tokens=4096, device="cpu",
                  span_head_tokens=2, span_query_share=0.3)
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outs = {}
    for name, kw in (("eager", {}), ("graphs", dict(attention_backend="triton"))):
        with Engine(**common, **kw) as e:
            runner = e.scheduler.runner
            if name == "graphs":
                runner.graph_runner = EmulatedGraphs(runner)
            outs[name] = [e.generate(p, params)["output_ids"] for p in PROBED]
    replays = runner.graph_runner.padded
    return {
        "dtype": "float32",
        "nan": False,
        "identical": outs["graphs"] == outs["eager"],
        "decode_replays": sum(mode == "DECODE" for mode, _ in replays) > 0,
        "padded_to_context": ("EXTEND", runner.model_config.context_len) in replays,
    }


ENGINE_CASES: dict[str, Callable[[], dict]] = {
    "graph_replay_engine": graph_replay_engine_case,
    "fp8_kv_engine": fp8_kv_engine_case,
    "span_attention_engine": span_attention_engine_case,
    "span_probe_engine": span_probe_engine_case,
    "kivi_engine": kivi_engine_case,
    "shared_decode_engine": shared_decode_engine_case,
    "shared_decode_common_prefix_engine": shared_decode_common_prefix_engine_case,
}
