"""What reading a shared span's KV once per decode step buys (kernels/shared_decode.py).

Every request holds the same cached span at its own offset: a private preface of 64-511 tokens, the span, a private
question and its answer so far (64 tokens). Three parts:
  kernel  decode attention of one step over a paged batch laid out like that, per-request kernel (flash-decoding,
          every request reads the span) vs the shared kernel (the span read once per step), both replayed from a
          CUDA graph with a cold L2; plus the host time of building the shared plan.
  engine  the offline Engine decoding those requests, with and without --disable-shared-decode: output tokens/s.
  plan    host time of planning one such step (managers/shared_decode_planner.py) with a GPU's settings; CPU only.

Usage: python benchmark/bench_shared_decode.py --part plan --batch-sizes 32,128,256 --span-lengths 8192
       python benchmark/bench_shared_decode.py --part kernel --batch-sizes 32,128 --span-lengths 2048,16384
       python benchmark/bench_shared_decode.py --part engine --model-path CFG_DIR --load-format dummy \
           --dtype bfloat16 --batch-sizes 64 --span-lengths 8192
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rag_spans import add_engine_args, device_name, engine_kwargs, resolve_paths  # noqa: E402
from bench_span_ttft import make_span  # noqa: E402
from graph_timing import graph_time_ms  # noqa: E402

TAIL_TOKENS = 64
PREFACE_RANGE = (64, 512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("kernel", "engine", "plan"), required=True)
    p.add_argument("--batch-sizes", default="32,128")
    p.add_argument("--span-lengths", default="2048,8192")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=128, help="engine part: tokens each request decodes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    add_engine_args(p)
    args = p.parse_args(argv)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.span_lengths = [int(x) for x in args.span_lengths.split(",")]
    return args


def layout(seed: int, batch_size: int, span: int) -> tuple[list[int], list[int]]:
    """(preface lengths, key counts) of the requests: preface, the span, TAIL_TOKENS of question and answer."""
    rng = random.Random(seed + batch_size + span)
    prefaces = [rng.randrange(*PREFACE_RANGE) for _ in range(batch_size)]
    return prefaces, [n + span + TAIL_TOKENS for n in prefaces]


def bench_kernel(args: argparse.Namespace, batch_size: int, span: int) -> dict[str, Any]:
    import paged_batch as pb
    from sglang_pic.kernels.decode_attention import alloc_decode_buffers, num_kv_splits
    from sglang_pic.kernels.reference import relative_errors
    from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings, plan_shared_decode

    prefaces, lens = layout(args.seed, batch_size, span)
    batch = pb.make_paged_batch([pb.decode(n) for n in lens], args.heads, args.kv_heads, args.head_dim,
                                torch.bfloat16, "cuda", seed=args.seed)
    runs = batch.share_keys([(0, prefaces[0], span, list(enumerate(prefaces))[1:])])
    device = batch.q.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    settings = SharedDecodeSettings.for_model(args.heads, args.kv_heads, sms, device)
    rows = batch.req_pool_indices.tolist()
    start = perf_counter()
    plan = plan_shared_decode(rows, lens, runs, settings, device)
    plan_ms = (perf_counter() - start) * 1e3
    splits = num_kv_splits(batch_size, args.kv_heads, sms)
    buffers = alloc_decode_buffers(batch_size, args.heads, args.head_dim, splits, device)
    per_request_out, shared_out = batch.poisoned_output(), batch.poisoned_output()

    def per_request() -> None:
        batch.run_decode(splits, out=per_request_out, buffers=buffers)

    def shared() -> None:
        from sglang_pic.kernels.shared_decode import shared_decode_attention_fwd

        shared_decode_attention_fwd(batch.q, shared_out, batch.kv(), plan, batch.kernel_cos_sin, batch.sm_scale)

    per_request_ms = graph_time_ms(per_request, args.rep_ms)
    shared_ms = graph_time_ms(shared, args.rep_ms)
    assert not shared_out.isnan().any(), "the shared kernel left NaN in its output"
    kv_bytes_per_key = args.kv_heads * 2 * args.head_dim * 2
    return {
        "batch": batch_size,
        "span": span,
        "keys_per_request": plan.keys_per_request,
        "keys_read": plan.keys_read,
        "per_request_ms": per_request_ms,
        "shared_ms": shared_ms,
        "speedup": per_request_ms / shared_ms,
        "per_request_gbps": plan.keys_per_request * kv_bytes_per_key / per_request_ms / 1e6,
        "shared_unique_gbps": plan.keys_read * kv_bytes_per_key / shared_ms / 1e6,
        "plan_host_ms": plan_ms,
        "items": plan.items.shape[0],
        "rel_err_vs_per_request": relative_errors(shared_out, per_request_out),
    }


def bench_plan(args: argparse.Namespace, batch_size: int, span: int, repeats: int = 200) -> dict[str, Any]:
    """Median host time of plan_shared_decode for one step of this layout, with an H200's settings (132 SMs)."""
    from statistics import median

    from sglang_pic.managers.shared_decode_planner import KeyRun, SharedDecodeSettings, plan_shared_decode

    prefaces, lens = layout(args.seed, batch_size, span)
    runs = [[KeyRun("span", n, span)] for n in prefaces]
    settings = SharedDecodeSettings.for_model(args.heads, args.kv_heads, 132, torch.device("cuda"))
    times = []
    for _ in range(repeats):
        start = perf_counter()
        plan = plan_shared_decode(list(range(batch_size)), lens, runs, settings, "cpu")
        times.append(perf_counter() - start)
    return {"batch": batch_size, "span": span, "plan_host_ms": median(times) * 1e3, "items": plan.items.shape[0]}


def bench_engine(args: argparse.Namespace, batch_size: int, span: int) -> list[dict[str, Any]]:
    from sglang_pic import Engine
    from sglang_pic.frontend_lang.markers import pdep
    from sglang_pic.frontend_lang.markers import span as span_marker
    from sglang_pic.tokenizer import load_tokenizer

    model_dir, tokenizer_dir = resolve_paths(args)
    tokenizer = load_tokenizer(tokenizer_dir)
    doc = make_span(tokenizer, span, args.seed)
    rng = random.Random(args.seed)
    filler = make_span(tokenizer, PREFACE_RANGE[1] * 2, args.seed + 1)
    ids = tokenizer.encode(filler, add_special_tokens=False)
    prompts = []
    for i in range(batch_size):
        lo = rng.randrange(0, len(ids) - PREFACE_RANGE[1])
        preface = tokenizer.decode(ids[lo : lo + rng.randrange(*PREFACE_RANGE)])
        prompts.append(f"Reader {i}. {preface}" + span_marker(doc) + pdep(f"Question {i}: what comes first?"))
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    rows = []
    outputs = {}
    for disabled in (False, True):
        engine = Engine(**dict(engine_kwargs(args, model_dir, tokenizer_dir), disable_shared_decode=disabled))
        try:
            engine.generate(prompts[:2], dict(params, max_new_tokens=4))  # caches the span, warms the engine
            before = engine.get_stats()
            start = perf_counter()
            outs = engine.generate(prompts, params)
            wall = perf_counter() - start
            after = engine.get_stats()
            shared_replays = getattr(engine.runner.graph_runner, "num_shared_replays", 0)
        finally:
            engine.shutdown()
        outputs[disabled] = [o["output_ids"] for o in outs]
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        rows.append({
            "batch": batch_size,
            "span": span,
            "shared_decode": not disabled,
            "wall_s": wall,
            "output_tok_s": tokens / wall,
            "decode_step_s": after["decode_step_s"] - before["decode_step_s"],
            "decode_steps": after["num_decode_steps"] - before["num_decode_steps"],
            "shared_decode_steps": after["shared_decode_steps"] - before["shared_decode_steps"],
            "shared_graph_replays": shared_replays,
            "cached_span_tokens": sum(o["meta_info"]["cached_span_tokens"] for o in outs),
        })
    same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    for row in rows:
        row["same_tokens_as_other"] = f"{same}/{batch_size}"
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    for batch_size in args.batch_sizes:
        for span in args.span_lengths:
            if args.part == "engine":
                found = bench_engine(args, batch_size, span)
            else:
                found = [(bench_kernel if args.part == "kernel" else bench_plan)(args, batch_size, span)]
            for row in found:
                row["device"] = device_name()
                print(json.dumps(row), flush=True)
            rows += found
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
