"""RAG throughput and TTFT: no cache vs prefix cache vs PIC (barrier) vs PIC + ISPS, in one process.

One script (over 400 lines): every mode must run in one process on the same workload, and the engine
flags it shares with bench_span_ttft.py live here.

Every mode serves the same 2WikiMultihopQA-shaped batch (see rag_workload.py), all samples submitted at once,
on a fresh Engine of the same build and device:
  no_cache      radix cache off, plain prompts: every prompt token is prefilled.
  prefix_cache  plain prompts, prefix caching only (what vLLM / SGLang give): a passage is reused only when
                everything before it matches too.
  pic_barrier   span markers, FCFS; the client first warms every span of the batch (Engine.warm_spans), waits,
                then sends the final prompts. Its TTFT includes the warm-up, since the requests had arrived.
  pic_isps      span markers, interleaved span-prefill scheduling: everything submitted at once; the scheduler
                prefills shared spans first, next to the running decodes.

Usage: python benchmark/bench_rag_spans.py --quick            (tiny CPU run)
       python benchmark/bench_rag_spans.py --model-path CFG_DIR --load-format dummy --dtype bfloat16
Long documents (about 23.6K prompt tokens a sample; a corpus of 100 keeps the ~220K tokens of distinct passages
inside an H100's KV pool): add --num-samples 64 --corpus-size 100 --passage-tokens 1000,4000 --hf-subset 0
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine_e2e import attn_flops, engine_params  # noqa: E402
from rag_workload import RagWorkload, WorkloadConfig, build_workload  # noqa: E402

from sglang_pic import Engine  # noqa: E402
from sglang_pic.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang_pic.managers.output_format import output_of  # noqa: E402
from sglang_pic.managers.req import Req, ReqSegment  # noqa: E402
from sglang_pic.model_config import resolve_dtype  # noqa: E402
from sglang_pic.span_policy import SELECT_CHOICES  # noqa: E402
from sglang_pic.tokenizer import load_tokenizer  # noqa: E402

MODES = ("no_cache", "prefix_cache", "pic_barrier", "pic_isps")
DEFAULT_OUT = Path(__file__).parent / "results"
WARM_UP_SAMPLES = 32  # workload samples run (and discarded) before each mode is timed


@dataclass(frozen=True)
class ModeSpec:
    engine_kwargs: dict[str, Any]
    marked: bool  # send span markers (else the plain prompt a PIC-unaware engine gets)
    barrier: bool  # warm the batch's spans with Engine.warm_spans before sending the prompts


MODE_SPECS = {
    "no_cache": ModeSpec({"disable_radix_cache": True, "disable_pic": True, "schedule_policy": "fcfs"}, False, False),
    "prefix_cache": ModeSpec({"disable_pic": True, "schedule_policy": "fcfs"}, False, False),
    "pic_barrier": ModeSpec({"schedule_policy": "fcfs"}, True, True),
    "pic_isps": ModeSpec({"schedule_policy": "isps"}, True, False),
}

# Workload and run sizes: the full run, and --quick (a tiny model on CPU: 256-token context). Flags override.
PRESETS = {
    "full": dict(
        num_samples=200, num_passages=10, corpus_size=1000, passage_tokens="100,200", max_question_tokens=30,
        max_new_tokens=32, hf_subset=0, hf_batch_sizes="1,8", max_total_tokens=None, dtype="auto",
    ),
    "quick": dict(
        num_samples=8, num_passages=3, corpus_size=8, passage_tokens="24,40", max_question_tokens=40,
        max_new_tokens=8, hf_subset=4, hf_batch_sizes="1,4", max_total_tokens=4096, dtype="float32",
    ),
}


@dataclass
class ModeResult:
    mode: str
    samples: int
    wall_s: float
    samples_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    e2e_p50_s: float
    warm_spans_s: float  # the barrier's warm-up (0 elsewhere); included in wall_s and in every TTFT
    prompt_tokens: int
    completion_tokens: int
    computed_prefill_tokens: int
    cached_prefix_tokens: int
    cached_span_tokens: int
    host_loaded_tokens: int  # cache hits copied back from host memory (--enable-hierarchical-cache)
    num_steps: int
    prefill_step_s: float  # wall time of the steps that ran prefill tokens (decodes riding along included)
    num_decode_steps: int  # steps that ran decodes only
    decode_step_s: float
    host_s: float  # wall time outside forward steps: scheduling, tokenizing, streaming outputs
    prefill_tflops: float | None  # no_cache only, where every prompt token is prefilled with full causal attention
    prefill_mfu: float | None  # prefill_tflops over --peak-tflops
    peak_token_usage: float  # fraction of the KV pool held by running requests, at its highest
    peak_kv_bytes: int
    cache_kv_tokens: int  # tokens the radix cache holds once the batch is done
    cache_kv_bytes: int
    kv_pool_bytes: int
    warm_spans_info: dict[str, Any] | None = None

    @property
    def reused_prefill_tokens(self) -> int:
        return self.cached_prefix_tokens + self.cached_span_tokens


@dataclass
class HFResult:
    batch_size: int
    samples: int
    wall_s: float
    samples_per_s: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--num-samples", type=int)
    p.add_argument("--num-passages", type=int, help="passages per sample")
    p.add_argument("--corpus-size", type=int)
    p.add_argument("--passage-tokens", help="MIN,MAX tokens of a passage, each drawn in the range (e.g. 1000,4000; "
                   "a range the tokenizer can't land in is refused)")
    p.add_argument("--max-question-tokens", type=int,
                   help="questions get their answer instruction only within this many tokens (never cut)")
    p.add_argument("--zipf", type=float, default=1.0, help="passage popularity skew (0: uniform)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--hf-subset", type=int, help="samples for the transformers reference (0: skip it)")
    p.add_argument("--hf-batch-sizes", help="comma-separated batch sizes for the transformers reference")
    p.add_argument("--step-token-budget", type=int, help="ISPS prefill tokens per step")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the device's measured dense bf16 matmul rate, the denominator of prefill_mfu (H200: 790)")
    p.add_argument("--quick", action="store_true", help="tiny CPU run: few, short samples")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="samples/s arriving as a Poisson stream (0: all at once); with arrivals the barrier mode "
                   "warms each sample's spans when it arrives and holds its prompt until they are cached")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of all modes, interleaved; each mode reports its median-throughput run and the "
                   "samples/s of every run (single runs of one mode vary by about 5%% on the H200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for rag_spans.json and rag_spans.png")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quantization and args.hf_subset:
        p.error("--quantization needs --hf-subset 0: the transformers reference runs the unquantized weights")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    bounds = args.passage_tokens.split(",")
    if len(bounds) != 2 or not all(b.strip().isdigit() for b in bounds):
        p.error(f"--passage-tokens takes MIN,MAX, got {args.passage_tokens!r}")
    args.passage_tokens = tuple(int(b) for b in bounds)
    try:
        workload_config(args)
    except ValueError as e:
        p.error(str(e))
    args.hf_batch_sizes = [int(x) for x in args.hf_batch_sizes.split(",") if x]
    return args


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """The workload the flags ask for (its constructor refuses impossible sizes)."""
    return WorkloadConfig(
        num_samples=args.num_samples, num_passages=args.num_passages, corpus_size=args.corpus_size, zipf=args.zipf,
        passage_tokens=args.passage_tokens, max_question_tokens=args.max_question_tokens, seed=args.seed,
    )


# ---- shared with bench_span_ttft.py ------------------------------------------------------------------------------
def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and KV-pool flags both benchmarks take (read back by `resolve_paths` and `engine_kwargs`)."""
    p.add_argument("--model-path", help="HF folder (or config folder with --load-format dummy); default: the "
                                        "embedded Qwen2.5-0.5B")
    p.add_argument("--tokenizer-path", help="tokenizer folder when the model folder has none")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy", "gguf"))
    p.add_argument("--dtype")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: by memory fraction)")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="keep KV the cache evicts in host memory (sized by --hicache-ratio)")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--span-anchor", help="the server's --span-anchor for the span modes (default: its default)")
    p.add_argument("--span-head-tokens", type=int,
                   help="the server's --span-head-tokens for the span modes (default: its default)")
    p.add_argument("--span-query-share", type=float,
                   help="the server's --span-query-share for the span modes (default: its default, no probe)")
    p.add_argument("--span-select", choices=SELECT_CHOICES,
                   help="the server's --span-select: how --span-query-share picks its tokens (default: query)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="commit each step's tokens before launching the next")
    p.add_argument("--disable-shared-decode", action="store_true",
                   help="every decode reads its own keys (no shared reads of cached runs, kernels/shared_decode.py)")
    p.add_argument("--attention-backend", help="the server's --attention-backend (default: its default)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the server's --kv-cache-dtype (e.g. fp8_e4m3)")
    p.add_argument("--quantization", help="the server's --quantization (fp8: weights and GEMMs in float8)")
    p.add_argument("--span-adapter", help="the server's --span-adapter (a folder, or auto)")
    p.add_argument("--span-adapter-scope", help="the server's --span-adapter-scope (default: spans)")


def resolve_paths(args: argparse.Namespace) -> tuple[str, str]:
    """(model folder, tokenizer folder); the default model is the embedded one."""
    from sglang_pic.model_loader.loader import model_dirs

    return model_dirs(args.model_path, args.tokenizer_path, args.load_format)


def engine_kwargs(args: argparse.Namespace, model_dir: str, tokenizer_dir: str) -> dict[str, Any]:
    kwargs = dict(
        model_path=model_dir, tokenizer_path=tokenizer_dir, load_format=args.load_format, dtype=args.dtype,
        max_total_tokens=args.max_total_tokens, random_seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.chunked_prefill_size is not None:
        kwargs["chunked_prefill_size"] = args.chunked_prefill_size
    if args.enable_hierarchical_cache:
        kwargs.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio)
    if args.disable_overlap_schedule:
        kwargs["disable_overlap_schedule"] = True
    if args.disable_shared_decode:
        kwargs["disable_shared_decode"] = True
    if args.attention_backend is not None:
        kwargs["attention_backend"] = args.attention_backend
    if args.span_anchor is not None:
        kwargs["span_anchor"] = args.span_anchor
    if args.span_head_tokens is not None:
        kwargs["span_head_tokens"] = args.span_head_tokens
    if args.span_query_share is not None:
        kwargs["span_query_share"] = args.span_query_share
    if args.span_select is not None:
        kwargs["span_select"] = args.span_select
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.span_adapter is not None:
        kwargs["span_adapter"] = args.span_adapter
    if args.span_adapter_scope is not None:
        kwargs["span_adapter_scope"] = args.span_adapter_scope
    return kwargs


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line arguments as JSON values (paths as strings), for a result file's record of its run."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def warm_up(engine: Engine, prompts: str | list[str], spans: list[str] | None = None) -> None:
    """Run prompts (and first warm `spans`, for the barrier workflow) through the mode's own path, then empty the
    cache, so first-use costs (allocator growth, lazy initialisation) fall outside the measurement. Triton kernels
    are compiled at engine startup (TritonAttnBackend.warm_up), whatever the mode."""
    if spans:
        engine.warm_spans(spans)
    engine.generate(prompts, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    if not engine.flush_cache():
        raise RuntimeError("the engine is not idle after the warm-up requests")


def serve_arrivals(
    engine: Engine, prompts: list[str], spans: list[list[str]] | None, params: dict, desc: str, rate: float, seed: int
) -> tuple[list[dict], float]:
    """Feed prompts as a Poisson stream, driving the scheduler in this thread; TTFT counts from each arrival.

    With `spans` (the barrier workflow) an arriving sample first queues its spans as prefill-only jobs, and its
    prompt joins the queue only once every one of them is cached.
    """
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(prompts)))
    builder, sched = engine.request_builder, engine.scheduler
    msgs: list = []
    reqs: list = []
    held: list[tuple] = []  # (request, its span jobs) waiting for the barrier
    peak, start = 0.0, perf_counter()
    with tqdm(total=len(prompts), desc=desc, unit="sample", leave=False) as bar:
        while len(reqs) < len(prompts) or held or not sched.is_idle():
            now = perf_counter() - start
            while len(reqs) < len(prompts) and arrivals[len(reqs)] <= now:
                i = len(reqs)
                (msg,) = builder.build(GenerateReqInput(text=prompts[i], sampling_params=params, rid=f"{desc}-{i}"))
                req = Req.from_wire(msg)
                msgs.append(msg)
                reqs.append(req)
                jobs = []
                if spans is not None:
                    jobs = sched.add_span_jobs([ReqSegment.from_wire(s) for s in builder.span_segments(spans[i])])
                held.append((req, jobs))
            for item in [h for h in held if all(job.finished() for job in h[1])]:
                held.remove(item)
                sched.add_request(item[0])
            if sched.is_idle():
                time.sleep(0.0005)
                continue
            done = sum(r.finished() for r in sched.step() if not r.warmup)
            bar.update(done)
            peak = max(peak, sched.token_usage())
    return [output_of(engine.formatter, m, r) for m, r in zip(msgs, reqs)], peak


# ---- one mode ----------------------------------------------------------------------------------------------------
def stream_batch(engine: Engine, prompts: list[str], params: dict, desc: str) -> tuple[list[dict], float]:
    """Submit all prompts at once; returns their final outputs and the peak fraction of the pool in use."""
    rids = [f"{desc}-{i}" for i in range(len(prompts))]
    final: dict[str, dict] = {}
    peak, seen_step = 0.0, -1
    sched = engine.scheduler
    with tqdm(total=len(prompts), desc=desc, unit="sample", leave=False) as bar:
        for chunk in engine.generate(prompts, params, rid=rids, stream=True):
            meta = chunk["meta_info"]
            if meta["finish_reason"] is not None and meta["id"] not in final:
                final[meta["id"]] = chunk
                bar.update(1)
            if sched.stats.num_steps != seen_step:
                seen_step = sched.stats.num_steps
                peak = max(peak, sched.token_usage())
    return [final[r] for r in rids], peak


def dense_prefill_flops(engine: Engine, outs: list[dict]) -> float:
    """FLOPs of prefilling every prompt token with full causal attention (what the no-cache mode computes)."""
    params = engine_params(engine)
    return sum(2 * params * n + attn_flops(engine, n) for n in (o["meta_info"]["prompt_tokens"] for o in outs))


def run_mode(mode: str, args: argparse.Namespace, workload: RagWorkload, common: dict[str, Any]) -> ModeResult:
    spec = MODE_SPECS[mode]
    kwargs = dict(common, **spec.engine_kwargs)
    if mode == "pic_isps" and args.step_token_budget is not None:
        kwargs["step_token_budget"] = args.step_token_budget
    engine = Engine(**kwargs)
    try:
        build = workload.prompt if spec.marked else workload.plain_prompt
        prompts = [build(s) for s in workload.samples]
        warm = workload.samples[:WARM_UP_SAMPLES]
        warm_spans = list(dict.fromkeys(p for smp in warm for p in workload.passages(smp))) if spec.barrier else None
        warm_up(engine, prompts[: len(warm)], warm_spans)
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
        before = engine.get_stats()
        start = perf_counter()
        if args.arrival_rate > 0:
            spans = [workload.passages(s) for s in workload.samples] if spec.barrier else None
            warm_info, warm_s = None, 0.0
            outs, peak = serve_arrivals(engine, prompts, spans, params, mode, args.arrival_rate, args.seed)
        else:
            warm_info = engine.warm_spans(workload.span_texts()) if spec.barrier else None
            warm_s = perf_counter() - start if spec.barrier else 0.0
            outs, peak = stream_batch(engine, prompts, params, mode)
        wall = perf_counter() - start
        after = engine.get_stats()
        flops = dense_prefill_flops(engine, outs) if mode == "no_cache" else None
        bytes_per_token = engine.runner.token_to_kv_pool.bytes_per_token()
        pool_tokens = engine.runner.max_total_num_tokens
        cache_tokens = engine.scheduler.tree.total_size()
    finally:
        engine.shutdown()  # frees its weights and KV pool: modes never share memory

    def delta(key: str) -> int:
        return int(after[key] - before[key])

    failed = [o["meta_info"]["finish_reason"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
    if failed:
        raise RuntimeError(f"{mode}: {len(failed)} requests were aborted, e.g. {failed[0]}")
    prefill_s = after["prefill_step_s"] - before["prefill_step_s"]
    decode_s = after["decode_step_s"] - before["decode_step_s"]
    tflops = flops / prefill_s / 1e12 if flops is not None and prefill_s > 0 else None
    ttft = np.array([o["meta_info"]["ttft"] for o in outs]) + warm_s
    e2e = np.array([o["meta_info"]["e2e_latency"] for o in outs]) + warm_s
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return ModeResult(
        mode=mode,
        samples=len(outs),
        wall_s=wall,
        samples_per_s=len(outs) / wall,
        output_tokens_per_s=completion / wall,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        ttft_mean_s=float(ttft.mean()),
        e2e_p50_s=float(np.percentile(e2e, 50)),
        warm_spans_s=warm_s,
        prompt_tokens=sum(o["meta_info"]["prompt_tokens"] for o in outs),
        completion_tokens=completion,
        computed_prefill_tokens=delta("computed_prefill_tokens"),
        cached_prefix_tokens=delta("cached_prefix_tokens"),
        cached_span_tokens=delta("cached_span_tokens"),
        host_loaded_tokens=delta("hicache_loaded_tokens"),
        num_steps=delta("num_steps"),
        prefill_step_s=prefill_s,
        num_decode_steps=delta("num_decode_steps"),
        decode_step_s=decode_s,
        host_s=wall - prefill_s - decode_s,
        prefill_tflops=tflops,
        prefill_mfu=tflops / args.peak_tflops if tflops is not None else None,
        peak_token_usage=peak,
        peak_kv_bytes=int(peak * pool_tokens * bytes_per_token),
        cache_kv_tokens=cache_tokens,
        cache_kv_bytes=cache_tokens * bytes_per_token,
        kv_pool_bytes=pool_tokens * bytes_per_token,
        warm_spans_info=warm_info,
    )


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run whose samples/s is the median (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r.samples_per_s)[(len(runs) - 1) // 2]


# ---- outside reference -------------------------------------------------------------------------------------------
def run_hf_reference(
    args: argparse.Namespace, model_dir: str, tokenizer_dir: str, prompts: list[str]
) -> list[HFResult]:
    """transformers `generate`, greedy, on plain prompts: the same work with no serving engine at all."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(args.dtype, str(getattr(config, "dtype", None) or ""), device)
    if args.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    tok = load_tokenizer(tokenizer_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    n = args.max_new_tokens

    def generate(batch: list[str], new_tokens: int) -> None:
        enc = tok(batch, return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)

    results = []
    try:
        for bs in args.hf_batch_sizes:
            batches = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
            generate(batches[0], 2)
            start = perf_counter()
            for batch in tqdm(batches, desc=f"hf bs={bs}", leave=False):
                generate(batch, n)
            if device == "cuda":
                torch.cuda.synchronize()
            wall = perf_counter() - start
            results.append(HFResult(bs, len(prompts), wall, len(prompts) / wall))
    finally:
        model = None  # drop the weights before the next mode (the closure above keeps the name)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


# ---- report ------------------------------------------------------------------------------------------------------
def plot(modes: list[ModeResult], hf: list[HFResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft, ax_tok) = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [m.mode for m in modes] + [f"hf bs={h.batch_size}" for h in hf]
    rates = [m.samples_per_s for m in modes] + [h.samples_per_s for h in hf]
    ax_tp.bar(labels, rates, color=["C0"] * len(modes) + ["C7"] * len(hf))
    ax_tp.set_ylabel("samples / s")
    ax_tp.set_title("throughput (all submitted at once)")
    x = np.arange(len(modes))
    ax_ttft.bar(x - 0.2, [m.ttft_p50_s for m in modes], 0.4, label="p50")
    ax_ttft.bar(x + 0.2, [m.ttft_p99_s for m in modes], 0.4, label="p99")
    ax_ttft.set_xticks(x, [m.mode for m in modes])
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.set_title("time to first token")
    ax_ttft.legend()
    ax_tok.bar(x, [m.computed_prefill_tokens for m in modes], label="computed")
    ax_tok.bar(x, [m.reused_prefill_tokens for m in modes], bottom=[m.computed_prefill_tokens for m in modes],
               label="reused from cache")
    ax_tok.set_xticks(x, [m.mode for m in modes])
    ax_tok.set_ylabel("prefill tokens")
    ax_tok.set_title("prefill work")
    ax_tok.legend()
    for ax in (ax_tp, ax_ttft, ax_tok):
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(modes: list[ModeResult], hf: list[HFResult]) -> None:
    print(f"{'mode':<14}{'samples/s':>11}{'ttft p50':>10}{'ttft p99':>10}{'computed':>11}{'reused':>10}"
          f"{'cache KV MiB':>14}")
    for m in modes:
        print(f"{m.mode:<14}{m.samples_per_s:>11.3f}{m.ttft_p50_s:>10.3f}{m.ttft_p99_s:>10.3f}"
              f"{m.computed_prefill_tokens:>11}{m.reused_prefill_tokens:>10}{m.cache_kv_bytes / 2**20:>14.1f}")
    for h in hf:
        print(f"{'hf bs=' + str(h.batch_size):<14}{h.samples_per_s:>11.3f}")
    print(f"{'mode':<14}{'steps':>7}{'prefill s':>11}{'decode-only':>13}{'decode s':>10}{'host s':>9}")
    for m in modes:
        print(f"{m.mode:<14}{m.num_steps:>7}{m.prefill_step_s:>11.2f}{m.num_decode_steps:>13}{m.decode_step_s:>10.2f}"
              f"{m.host_s:>9.2f}")
    for m in modes:
        if m.prefill_tflops is not None:
            print(f"{m.mode} prefill: {m.prefill_tflops:.0f} TFLOP/s over its prefill steps, MFU {m.prefill_mfu:.1%}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir, tokenizer_dir = resolve_paths(args)
    tokenizer = load_tokenizer(tokenizer_dir)
    workload = build_workload(workload_config(args),
                              lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    print(workload.describe())
    common = engine_kwargs(args, model_dir, tokenizer_dir)
    rounds = [(r, mode) for r in range(args.repeats) for mode in args.modes]
    runs: dict[str, list[ModeResult]] = {mode: [] for mode in args.modes}
    for _, mode in tqdm(rounds, desc="modes", unit="mode"):
        runs[mode].append(run_mode(mode, args, workload, common))
    modes = [median_run(runs[mode]) for mode in args.modes]
    hf: list[HFResult] = []
    if args.hf_subset > 0:
        hf = run_hf_reference(args, model_dir, tokenizer_dir,
                              [workload.plain_prompt(s) for s in workload.samples[: args.hf_subset]])
    result = {
        "config": args_json(args),
        "device": device_name(),
        "torch": torch.__version__,
        "model_dir": model_dir,
        "workload": workload.summary(),
        "modes": {m.mode: dict(asdict(m), reused_prefill_tokens=m.reused_prefill_tokens) for m in modes},
        "samples_per_s_runs": {mode: [r.samples_per_s for r in rs] for mode, rs in runs.items()},
        "hf_reference": [asdict(h) for h in hf],
    }
    write_json(args.out / "rag_spans.json", result)
    plot(modes, hf, args.out / "rag_spans.png")
    print_table(modes, hf)
    if args.repeats > 1:
        for mode, rs in runs.items():
            rates = sorted(r.samples_per_s for r in rs)
            print(f"{mode}: samples/s over {len(rs)} runs {rates[0]:.2f} .. {rates[-1]:.2f} (table: the median run)")
    print(f"wrote {args.out / 'rag_spans.json'} and {args.out / 'rag_spans.png'}")
    return result


if __name__ == "__main__":
    main()
