"""What position-free keys cost: Triton attention with in-kernel key RoPE vs the same kernels on pre-rotated keys.

Every case times both variants on one set of inputs: `position_free` (keys stored unrotated and rotated inside
attention from their index) and `prerotated` (the standard engine layout: keys rotated once at store time, only
queries rotated in attention). Both are the same kernel body compiled with ROTATE_KEYS on and off. Kernel cost
does not depend on the key values, so the decode baseline reads the same buffer; it also runs at its own better
split count (see bench_decode). Extends are timed as the step that stores the new tokens' k/v and attends, since
position-free keys move work between the two: for extends with many queries per key the engine stages keys
(rotated once into a workspace, see kernels/stage_keys.py), the store writing the new keys' rotated copies and a
staging pass the cached ones (`stage_ms` alone); `in_kernel_ms` times in-kernel rotation as well.

Variants are timed in `--rounds` interleaved rounds whose order reverses every round, and the median is kept;
`noise_pct` is the largest spread of one variant's rounds, below which differences are noise. Each case also
records the GPU's lowest SM clock, highest power and whether it throttled under load while it ran (nvidia-smi,
gpu_telemetry.py): at its 700 W cap an H200 slows the variant that does more work per byte more.

Cases: decode (flash-decoding, batch x context grid), extend (prefill, prefix extends, span prefills), and the
KV store. Each call is captured in a CUDA graph and timed by triton.testing.do_bench on its replays (L2 flushed
before each replay, median): launch overhead stays out and data comes from HBM as it would per layer.
Reports time, achieved TFLOP/s (extend; visible query-key pairs only), GB/s (decode: KV bytes read; store:
bytes moved) and the overhead of position-free keys in percent; writes everything to a JSON file.

  python benchmark/bench_attention_kernels.py --out benchmark/results/attention_kernels_h200.json [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Callable

import torch
from gpu_telemetry import Telemetry
from attention_report import KINDS, log_row, print_summary
from graph_timing import ceilings, graph_time_ms, interleaved_ms, spread_pct

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # auto: --dtype
FULL = {
    "batches": [1, 8, 32, 64, 128, 256],
    "contexts": [1024, 4096, 8192, 16384, 32768],
    "prefill": [1024, 2048, 4096, 8192],
}
QUICK = {"batches": [1, 32, 256], "contexts": [1024, 8192, 32768], "prefill": [1024, 8192]}
SWEEP_DECODE_SHAPES = [(1, 32768), (64, 8192), (256, 2048)]  # (batch, context)
SWEEP_EXTEND_CASES = ["prefill_8x1024", "prefill_1x8192", "extend_64_on_32k_prefix", "verify_32x9_on_16k"]
STORE_TOKENS = 8192
PRE_ROTATED_PROGRAMS_PER_SM = 3  # the pre-rotated decode split kernel's shared memory fits 3 per H200 SM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmark/results/attention_kernels.json"))
    p.add_argument("--quick", action="store_true", help="a 3x3 decode grid and two prefill lengths (about a minute)")
    p.add_argument("--sweep", action="store_true", help="also time alternative tile configs on a few shapes")
    p.add_argument("--batches", type=_ints, help="decode batch sizes, comma-separated")
    p.add_argument("--contexts", type=_ints, help="decode context lengths, comma-separated")
    p.add_argument("--prefill", type=_ints, help="prefill lengths, comma-separated (requests = 8192 // length)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="auto",
                   help="the pool's dtype, as the server's --kv-cache-dtype (auto: --dtype)")
    p.add_argument("--max-kv-tokens", type=int, default=8 * 2**20, help="skip decode cases with batch x context above")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurements of each variant (median kept)")
    p.add_argument("--kinds", type=_kinds, default=KINDS, help="cases to run, comma-separated: decode,extend,store")
    args = p.parse_args(argv)
    grid = QUICK if args.quick else FULL
    args.batches = args.batches or grid["batches"]
    args.contexts = args.contexts or grid["contexts"]
    args.prefill = args.prefill or grid["prefill"]
    return args


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        named = f"unknown case kinds {unknown}" if unknown else "no case kinds given"
        raise argparse.ArgumentTypeError(f"{named}; choose from {','.join(KINDS)}")
    return kinds


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _make_batch(args: argparse.Namespace, specs: list, seed: int, device: str = DEVICE):
    from paged_batch import make_paged_batch

    dims = (args.heads, args.kv_heads, args.head_dim)
    return make_paged_batch(specs, *dims, DTYPES[args.dtype], device, page_size=args.page_size, seed=seed,
                            kv_dtype=KV_DTYPES[args.kv_dtype])


def bench_decode(args: argparse.Namespace, batch_size: int, context: int, config=None) -> dict:
    """Both variants at the engine's split count; the pre-rotated one also at the count that fills its own waves,
    keeping the faster: the engine's count is chosen for the position-free kernel's 2 programs per SM, while the
    pre-rotated one fits 3 per SM, so that count alone would handicap the baseline."""
    from sglang_pic.kernels.decode_attention import alloc_decode_buffers, num_kv_splits
    from paged_batch import decode

    specs = [decode(context)] * batch_size
    batch = _make_batch(args, specs, seed=batch_size + context)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    splits = num_kv_splits(batch_size, args.kv_heads, sms)
    own_waves = num_kv_splits(batch_size, args.kv_heads, sms, resident_per_sm=PRE_ROTATED_PROGRAMS_PER_SM)
    out = batch.poisoned_output()

    def launch(keys_rotated: bool, n: int) -> Callable[[], object]:
        buffers = alloc_decode_buffers(batch_size, args.heads, args.head_dim, n, batch.q.device)
        return lambda: batch.run_decode(n, keys_rotated, out=out, buffers=buffers, config=config)

    pre_counts = sorted({splits, own_waves})
    fns = {"free": launch(False, splits), **{f"pre_{n}": launch(True, n) for n in pre_counts}}
    times = interleaved_ms(fns, args.rep_ms, args.rounds)
    pre_splits = min(pre_counts, key=lambda n: median(times[f"pre_{n}"]))
    free, pre = median(times["free"]), median(times[f"pre_{pre_splits}"])
    result = {
        "position_free_ms": free,
        "prerotated_ms": pre,
        "overhead_pct": 100.0 * (free / pre - 1.0),
        "noise_pct": spread_pct(times),
        "rounds": times,
    }
    kv_bytes = batch_size * context * args.kv_heads * 2 * args.head_dim * batch.k_buffer.element_size()
    result.update(
        batch=batch_size,
        context=context,
        kv_splits=splits,
        prerotated_kv_splits=pre_splits,
        kv_gb=kv_bytes / 1e9,
        position_free_gbps=kv_bytes / result["position_free_ms"] / 1e6,
        prerotated_gbps=kv_bytes / result["prerotated_ms"] / 1e6,
    )
    assert not out.isnan().any(), "decode left NaN in its output"
    return result


def extend_cases(prefill_lens: list[int]) -> dict[str, list]:
    from paged_batch import extend, prefill, spans

    cases = {}
    for n in prefill_lens:
        requests = max(1, 8192 // n)
        cases[f"prefill_{requests}x{n}"] = [prefill(n)] * requests
    cases["extend_1k_on_8k_prefix"] = [extend(9216, 1024)] * 4
    cases["extend_1k_on_31k_prefix"] = [extend(32768, 1024)]
    cases["extend_64_on_32k_prefix"] = [extend(32768 + 64, 64)]  # a prompt whose 32K span is cached
    cases["extend_30_on_8k_prefix"] = [extend(8192 + 30, 30)]  # a short question behind a cached 8K span
    cases["verify_32x9_on_16k"] = [extend(16384 + 9, 9)] * 32  # a VeriCache verification of 8 drafts
    span_list = [(i * 1024, i * 1024 + 1000) for i in range(8)]
    cases["spans_8x1000_plus_512_pdep"] = [spans(8192 + 512, span_list, 512)] * 2
    return cases


def bench_extend(args: argparse.Namespace, name: str, specs: list, config=None) -> dict:
    """One layer's attention work for the new tokens, as the engine runs it: store their k/v, then attend. The
    position-free step stores keys unrotated and, where the engine stages keys (many query rows per key), writes
    the new keys' rotated copies to the staging workspace in the same store, stages the cached keys and runs the
    kernel on the workspace; elsewhere the kernel rotates keys itself. The pre-rotated step rotates keys in the
    store and attends over a pool of rotated keys. `overhead_pct` compares the steps; `attention_overhead_pct` the
    attention alone where no work moved into the store (in-kernel rotation); `in_kernel_ms` times the step with
    in-kernel rotation also where the engine stages; `stage_ms` the staging pass alone."""
    from sglang_pic.kernels.stage_keys import has_cached_keys, should_stage_keys
    from sglang_pic.kernels.store_kv import store_kv, store_kv_rotated

    batch = _make_batch(args, specs, seed=len(name))
    out = batch.poisoned_output()
    staged = should_stage_keys(sum(batch.seq_lens_cpu), batch.k_buffer, batch.query_rows(), batch.q.dtype)
    pre_k = batch.k_buffer.clone()  # the baseline's pool: the store rotates its new keys, the rest stay as they are
    new_kv = (batch.out_cache_loc, batch.k_new, batch.v_new)

    def free_attention() -> None:  # keys rotated in-kernel
        batch.run_extend(False, out=out, config=config, stage=False)

    def pre_attention() -> None:
        batch.run_extend(True, k_buffer=pre_k, out=out, config=config)

    def in_kernel_step() -> None:
        store_kv(batch.k_buffer, batch.v_buffer, *new_kv, batch.kernel_cos_sin)
        free_attention()

    def staged_step() -> None:  # the store inside writes the new keys' rotated copies to the workspace
        batch.run_extend(False, out=out, config=config, stage=True)

    def pre_step() -> None:
        store_kv_rotated(pre_k, batch.v_buffer, *new_kv, batch.positions, batch.kernel_cos_sin)
        pre_attention()

    fns = {"free": staged_step if staged else in_kernel_step, "pre": pre_step}
    if staged:
        fns["in_kernel"] = in_kernel_step
    else:
        fns["free_attention"] = free_attention
        fns["pre_attention"] = pre_attention
    times = interleaved_ms(fns, args.rep_ms, args.rounds)
    ms = {name: median(t) for name, t in times.items()}
    assert not out.isnan().any(), "extend left NaN in its output"
    in_kernel = ms.get("in_kernel", ms["free"])
    pairs = sum(p - lo + 1 for s in specs for p, lo in zip(s.positions, s.attn_lo))
    flops = 4 * args.heads * args.head_dim * pairs  # q.k and p.v over visible pairs
    result = {
        "case": name,
        "requests": len(specs),
        "new_tokens": sum(batch.extend_seq_lens_cpu),
        "visible_pairs": pairs,
        "staged": staged,
        "position_free_ms": ms["free"],
        "prerotated_ms": ms["pre"],
        "overhead_pct": 100.0 * (ms["free"] / ms["pre"] - 1.0),
        "noise_pct": spread_pct(times),
        "in_kernel_ms": in_kernel,
        "in_kernel_overhead_pct": 100.0 * (in_kernel / ms["pre"] - 1.0),
        "position_free_tflops": flops / ms["free"] / 1e9,
        "prerotated_tflops": flops / ms["pre"] / 1e9,
        "rounds": times,
    }
    result["stage_ms"] = 0.0  # a prefill's keys all come through the store: no staging pass
    if staged and has_cached_keys(batch.seq_lens_cpu, batch.extend_seq_lens_cpu):
        result["stage_ms"] = graph_time_ms(batch.stage_cached_keys, args.rep_ms)
    if not staged:
        result["attention_overhead_pct"] = 100.0 * (ms["free_attention"] / ms["pre_attention"] - 1.0)
    return result


def bench_store(args: argparse.Namespace, tokens: int) -> dict:
    """The store of a prefill's k/v: unrotated (position-free), unrotated plus the rotated copies of the keys in a
    staging workspace (position-free, keys staged) and rotated (the baseline pays rotation at store time)."""
    from paged_batch import prefill
    from sglang_pic.kernels.stage_keys import alloc_staged_keys
    from sglang_pic.kernels.store_kv import store_kv, store_kv_rotated

    batch = _make_batch(args, [prefill(tokens)], seed=tokens)
    k, v, loc, pos = batch.k_new, batch.v_new, batch.out_cache_loc, batch.positions
    k_buf, v_buf, table = batch.k_buffer, batch.v_buffer, batch.kernel_cos_sin
    staged = alloc_staged_keys(batch.kv(), batch.ext(), tokens, batch.q.dtype)
    fns = {
        "free": lambda: store_kv(k_buf, v_buf, loc, k, v, table),
        "free_staged": lambda: store_kv(k_buf, v_buf, loc, k, v, table, staged, pos),
        "pre": lambda: store_kv_rotated(k_buf, v_buf, loc, k, v, pos, table),
    }
    times = interleaved_ms(fns, args.rep_ms, args.rounds)
    ms = {name: median(t) for name, t in times.items()}
    moved = (k.numel() + v.numel()) * (k.element_size() + k_buf.element_size())  # read in, written to the pool
    return {
        "tokens": tokens,
        "position_free_ms": ms["free"],
        "position_free_staged_ms": ms["free_staged"],
        "prerotated_ms": ms["pre"],
        "overhead_pct": 100.0 * (ms["free"] / ms["pre"] - 1.0),
        "staged_overhead_pct": 100.0 * (ms["free_staged"] / ms["pre"] - 1.0),
        "noise_pct": spread_pct(times),
        "position_free_gbps": moved / ms["free"] / 1e6,
        "prerotated_gbps": moved / ms["pre"] / 1e6,
        "rounds": times,
    }


def sweep(args: argparse.Namespace) -> list[dict]:
    """Alternative tiles on a few shapes, to check the defaults (the first config of each list)."""
    from sglang_pic.kernels.decode_attention import DecodeConfig, default_decode_config
    from sglang_pic.kernels.extend_attention import ExtendConfig

    dtype, cuda = DTYPES[args.dtype], torch.device(DEVICE)
    decode_cfgs = [default_decode_config(args.head_dim, dtype, cuda)] + [
        DecodeConfig(block_n=64, min_split_len=256, num_warps=4, num_stages=2),
        DecodeConfig(block_n=64, min_split_len=256, num_warps=4, num_stages=4),
        DecodeConfig(block_n=32, min_split_len=256, num_warps=4, num_stages=3),
        DecodeConfig(block_n=128, min_split_len=512, num_warps=4, num_stages=3),
        DecodeConfig(block_n=128, min_split_len=256, num_warps=8, num_stages=3),
        # fp8 pools: a block of 256 keys moves bf16's 128-key bytes; one stage keeps shared memory free for more
        # programs per SM
        DecodeConfig(block_n=256, min_split_len=256, num_warps=8, num_stages=2),
        DecodeConfig(block_n=128, min_split_len=256, num_warps=4, num_stages=1),
        DecodeConfig(block_n=256, min_split_len=256, num_warps=8, num_stages=1),
    ]
    extend_cfgs = [None] + [  # None: the engine's own pick, which depends on the case's query rows
        ExtendConfig(block_m=256, block_n=64, num_warps=8, num_stages=2),
        ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
        ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
        ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=2),
        ExtendConfig(block_m=128, block_n=32, num_warps=4, num_stages=3),
        ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
        ExtendConfig(block_m=64, block_n=128, num_warps=4, num_stages=2),
    ]
    rows = []
    for batch_size, context in SWEEP_DECODE_SHAPES if "decode" in args.kinds else []:
        for cfg in decode_cfgs:
            rows.append({"kind": "decode", "config": asdict(cfg), **bench_decode(args, batch_size, context, cfg)})
            log_row(rows[-1])
    cases = extend_cases([1024, 8192]) if "extend" in args.kinds else {}
    for name in SWEEP_EXTEND_CASES if cases else []:
        for cfg in extend_cfgs:
            config = asdict(cfg) if cfg else "default"
            rows.append({"kind": "extend", "config": config, **bench_extend(args, name, cases[name], cfg)})
            log_row(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    decode_grid = [(b, c) for b in args.batches for c in args.contexts if b * c <= args.max_kv_tokens]
    decode_grid = decode_grid if "decode" in args.kinds else []
    cases = extend_cases(args.prefill) if "extend" in args.kinds else {}
    if not torch.cuda.is_available():
        store = ", the store" if "store" in args.kinds else ""
        extra = " and a config sweep" if args.sweep else ""
        print(
            f"no CUDA device; would run {len(decode_grid)} decode cases, {len(cases)} extend cases{store}{extra}; "
            f"results to {args.out}"
        )
        return 0
    import triton

    started = time.time()
    report = {
        "meta": {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "dtype": args.dtype,
            "kv_dtype": args.kv_dtype,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "timing": "CUDA-graph replay, triton.testing.do_bench median, L2 flushed before each replay",
            "telemetry": "per case: nvidia-smi samples every 100 ms (gpu_telemetry.py), lowest SM clock, highest "
            "power, whether a power or thermal throttle reason was active",
        },
        "ceilings": ceilings(args.rep_ms),
    }
    print(f"ceilings: {report['ceilings']}", flush=True)

    spans: list[tuple[dict, float, float]] = []  # each row and when it was measured, for its telemetry window
    with Telemetry() as telemetry:

        def measured(kind: str, bench: Callable[..., dict], *bench_args) -> dict:
            start = time.time()
            row = {"kind": kind, **bench(args, *bench_args)}
            spans.append((row, start, time.time()))
            log_row(row)
            return row

        report["decode"] = []
        for batch_size, context in decode_grid:
            report["decode"].append(measured("decode", bench_decode, batch_size, context))
            torch.cuda.empty_cache()
        report["extend"] = [measured("extend", bench_extend, name, specs) for name, specs in cases.items()]
        report["store"] = [measured("store", bench_store, STORE_TOKENS)] if "store" in args.kinds else []
        if args.sweep:
            report["sweep"] = sweep(args)
    for row, start, end in spans:
        row["telemetry"] = telemetry.window(start, end)
    report["meta"]["wall_s"] = time.time() - started

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"wrote {args.out} in {report['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
