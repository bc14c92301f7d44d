"""VeriCache benchmarks: (a) draft acceptance vs compressor, budget and draft length on a real model; (b) long-
context decode throughput of VeriCache vs full-KV decoding with the same device KV memory.

One script (over 400 lines): (a) and (b) share the prompt builders and the engine setup.

(a) Prompts come from the Python standard library's own sources (nothing to download): `code` continues a module
cut at a line boundary; `retrieval` packs several modules' functions and then asks for one defined far back to
be written out again. Each configuration decodes the prompts greedily; its output is checked token for token
against full-KV decoding (`lossless`), and acceptance rate, tokens per round and the draft/verify time split are
recorded. The model defaults to the embedded Qwen2.5-Coder-0.5B.

(b) A Llama-3-8B-shaped model with dummy weights (decode cost depends only on shapes) decodes a batch of random
prompts of 16K-128K tokens: full-KV decoding, VeriCache with the full KV in device memory, and VeriCache with the
full KV in host memory streamed to the device for verification (the device then keeps only drafts, so more
requests fit the same --max-total-tokens). Random weights make acceptance meaningless, so next to the measured
tokens/s each VeriCache row gives the round time (draft and verify parts) and tokens/s projected for the
acceptance lengths of (a) (or --assume-accept-length). With --tp-model-path a real model decodes (a)'s code and
retrieval prompts instead, so the measured tokens/s carry its real acceptance, and each VeriCache row says
whether its tokens equal those of full-KV decoding of the same prompts.

  python benchmark/bench_vericache.py --out benchmark/results/vericache_h200.json
  python benchmark/bench_vericache.py --quick        # CPU: small model settings, about a minute
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine_e2e import LLAMA3_8B, TINY, rand_prompts, timed, write_config  # noqa: E402
from bench_rag_spans import args_json, write_json  # noqa: E402
from sglang_pic import Engine  # noqa: E402
from sglang_pic.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang_pic.managers.req import Req  # noqa: E402
from sglang_pic.speculative.vericache_worker import VeriCacheWorker  # noqa: E402

FULL = dict(
    compressors=["streaming", "snapkv", "h2o", "kivi"], budgets=[256, 1024, 0.1], draft_lengths=[4, 8, 16],
    prompt_tokens=4096, new_tokens=64, num_prompts=4, contexts=[16384, 32768, 65536, 131072], batch=4,
    host_batch=16, decode_steps=64, tp_budget=2048, tp_draft=8, max_total_tokens=None,
)
WINDOW_HEADROOM = 4  # (b) requests may output this many times --decode-steps: early ones run ahead of late ones
QUICK = dict(
    compressors=["streaming", "snapkv", "h2o", "kivi"], budgets=[64], draft_lengths=[4],
    prompt_tokens=256, new_tokens=8, num_prompts=1, contexts=[1024], batch=2, host_batch=4,
    decode_steps=8, tp_budget=64, tp_draft=4, max_total_tokens=4096,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON file; default: benchmark/results/vericache[_quick].json")
    p.add_argument("--quick", action="store_true", help="small settings that run on a CPU in about a minute")
    p.add_argument("--parts", default="acceptance,throughput")
    p.add_argument("--model-path", help="model for (a); default: the embedded Qwen2.5-Coder-0.5B")
    p.add_argument("--dtype", default="auto",
                   help="dtype; float32 makes (a)'s `lossless` exact on GPU too; (b) defaults to bfloat16 on GPU")
    p.add_argument("--compressors", type=_strs)
    p.add_argument("--budgets", type=_floats, help="draft budgets: < 1 a share of the context, >= 1 tokens")
    p.add_argument("--draft-lengths", type=_ints)
    p.add_argument("--prompt-tokens", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--num-prompts", type=int, help="prompts per task")
    p.add_argument("--contexts", type=_ints, help="(b) prompt lengths")
    p.add_argument("--batch", type=int, help="(b) requests for full-KV and VeriCache with device full KV")
    p.add_argument("--host-batch", type=int, help="(b) requests for VeriCache with host full KV")
    p.add_argument("--decode-steps", type=int)
    p.add_argument("--tp-budget", type=float, help="(b) VeriCache budget")
    p.add_argument("--tp-draft", type=int, help="(b) draft length")
    p.add_argument("--tp-compressors", type=_strs, default=["streaming"], help="(b) VeriCache compressors")
    p.add_argument("--tp-model-path", help="(b) a real model decoding (a)'s prompts instead of dummy Llama-3-8B")
    p.add_argument("--json-model-override-args", default="",
                   help="(b) JSON merged into the real model's config, e.g. YaRN rope_scaling past its native context")
    p.add_argument("--chunked-prefill-size", type=int, help="(a) prefill chunk; smaller bounds CPU attention memory")
    p.add_argument("--max-total-tokens", type=int, help="(b) device KV tokens; default: enough for --batch")
    p.add_argument("--tp-staging-share", type=float, default=0.4,
                   help="(b) share of the device KV memory that host-tier modes stage verification layers in")
    p.add_argument("--host-mem-gb", type=float, default=96.0, help="(b) host memory the host tier may use")
    p.add_argument(
        "--stagger-groups", type=int, default=1, help="(b) above 1, also VeriCache host full KV with staggered rounds"
    )
    p.add_argument("--modes", type=_strs, help="(b) only these modes (default: all)")
    p.add_argument("--assume-accept-length", type=_floats, help="(b) accept lengths to project; default from (a)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = Path(f"benchmark/results/vericache{'_quick' if args.quick else ''}.json")
    return args


def _strs(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in _strs(text)]


def _floats(text: str) -> list[float]:
    return [float(x) for x in _strs(text)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- (a) prompts from the standard library ----------------------------------------------------------------


@dataclass
class Prompt:
    task: str
    source: str
    ids: list[int]


def stdlib_modules(min_chars: int) -> list[Path]:
    root = Path(os.__file__).parent
    return [p for p in sorted(root.glob("*.py")) if p.stat().st_size >= min_chars]


def code_prompts(tokenizer, n: int, tokens: int) -> list[Prompt]:
    """Python source cut to `tokens` tokens at a line end, for the model to continue: a stdlib module where one is
    long enough, else consecutive modules joined under their file names (a repository read front to back)."""
    whole = stdlib_modules(tokens * 6)[::7][:n]
    modules = stdlib_modules(4000)
    out = []
    for i in range(n):
        if i < len(whole):
            name, source = whole[i].name, whole[i].read_text()
        else:
            start = i * 37 % len(modules)
            name, source = f"repo{i}", ""
            for path in modules[start:] + modules[:start]:
                source += f"# file: {path.name}\n{path.read_text()}\n"
                if len(source) >= tokens * 6:
                    break
        text = tokenizer.decode(tokenizer.encode(source)[:tokens])
        out.append(Prompt("code", name, tokenizer.encode(text[: text.rfind("\n") + 1])))
    return out


def _functions(path: Path) -> list[tuple[str, str]]:
    text = path.read_text()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    return [
        (node.name, "".join(lines[node.lineno - 1 : node.end_lineno]))
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    ]


def retrieval_prompts(tokenizer, n: int, tokens: int) -> list[Prompt]:
    """Top-level functions of several modules, then a request to write out one from the first third again."""
    out = []
    modules = stdlib_modules(4000)
    for i in range(n):
        pieces, count = [], 0
        for path in modules[i * 5 :] + modules[: i * 5]:
            for name, body in _functions(path):
                cost = len(tokenizer.encode(body)) + 2
                if count + cost > tokens * 0.9:
                    break
                pieces.append((name, body))
                count += cost
            if count > tokens * 0.8:
                break
        name, _ = pieces[len(pieces) // 4]
        text = "\n\n".join(body for _, body in pieces)
        ask = f"\n\n# The function `{name}` defined above, copied exactly:\ndef {name}("
        out.append(Prompt("retrieval", name, tokenizer.encode(text + ask)))
    return out


# ---- (a) acceptance -----------------------------------------------------------------------------------------


def submit(engine: Engine, ids: list[list[int]], params: dict) -> list[Req]:
    """Queue requests on the scheduler directly, keeping them (they carry their speculation records)."""
    reqs = engine.make_reqs(GenerateReqInput(input_ids=ids, sampling_params=params))
    for req in reqs:
        engine.scheduler.add_request(req)
    return reqs


def step_until(engine: Engine, done) -> None:
    while not done():
        engine.scheduler.step()


def run_requests(engine: Engine, ids: list[list[int]], params: dict) -> list[Req]:
    """Generate through the scheduler directly, returning the finished requests."""
    reqs = submit(engine, ids, params)
    step_until(engine, lambda: all(r.finished() for r in reqs))
    return reqs


def set_speculation(engine: Engine, **fields) -> None:
    """Give the (idle) engine a fresh VeriCache worker with these settings, or none (speculative_algorithm=None)."""
    for key, value in fields.items():
        setattr(engine.server_args, key, value)
    sched = engine.scheduler
    sched.spec_worker = VeriCacheWorker(sched.spec_host) if engine.server_args.speculative_algorithm else None


def bench_acceptance(args) -> dict:
    from sglang_pic.model_loader.default_model import default_model_path

    path = args.model_path or default_model_path()
    chunk = {} if args.chunked_prefill_size is None else {"chunked_prefill_size": args.chunked_prefill_size}
    engine = Engine(model_path=path, max_total_tokens=max(65536, 4 * args.prompt_tokens), schedule_policy="fcfs",
                    dtype=args.dtype, speculative_algorithm="vericache", **chunk)
    prompts = code_prompts(engine.tokenizer, args.num_prompts, args.prompt_tokens)
    prompts += retrieval_prompts(engine.tokenizer, args.num_prompts, args.prompt_tokens)
    params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    ids = [p.ids for p in prompts]
    set_speculation(engine, speculative_algorithm=None)
    engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 1})  # warm-up, fills the prefix cache
    _sync()
    start = time.perf_counter()
    reference = [r.output_ids for r in run_requests(engine, ids, params)]
    _sync()
    result = {"model": str(path), "full_kv_wall_s": time.perf_counter() - start, "runs": [],
              "prompts": [{"task": p.task, "source": p.source, "tokens": len(p.ids)} for p in prompts]}
    for compressor in args.compressors:
        for budget in args.budgets:
            for k in args.draft_lengths:
                set_speculation(engine, speculative_algorithm="vericache", vericache_compressor=compressor,
                                vericache_budget=budget, speculative_num_draft_tokens=k, vericache_full_kv="gpu")
                _sync()
                start = time.perf_counter()
                reqs = run_requests(engine, ids, params)
                _sync()
                wall = time.perf_counter() - start
                stats = engine.scheduler.spec_worker.stats.to_dict()
                per_task = {task: _task_acceptance(reqs, prompts, task) for task in ("code", "retrieval")}
                run = {"compressor": compressor, "budget": budget, "draft_length": k, "wall_s": wall,
                       "lossless": [r.output_ids for r in reqs] == reference, "per_task": per_task, **stats}
                result["runs"].append(run)
                print(f"(a) {compressor:9s} budget={budget:<6g} k={k:<3d} accept_rate={stats['accept_rate']:.3f} "
                      f"accept_len={stats['accept_length']:.2f} lossless={run['lossless']} {wall:.1f}s", flush=True)
    set_speculation(engine, speculative_algorithm=None)
    return result


def _task_acceptance(reqs: list[Req], prompts: list[Prompt], task: str) -> dict:
    """Tokens per round and acceptance rate over one task's requests (from each request's own record)."""
    records = [r.spec_stats for r, p in zip(reqs, prompts) if p.task == task and getattr(r, "spec_stats", None)]
    rounds = sum(s.verify_ct for s in records)
    drafted = sum(s.draft_tokens for s in records)
    return {
        "accept_length": sum(s.committed_tokens for s in records) / rounds if rounds else 0.0,
        "accept_rate": sum(s.accepted_drafts for s in records) / drafted if drafted else 0.0,
    }


# ---- (b) throughput ---------------------------------------------------------------------------------------


def bench_throughput(args, accept_lengths: list[float]) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if device == "cuda" else "float32"
    if args.tp_model_path:
        accept_lengths = []  # measured, not projected
        model = dict(model_path=args.tp_model_path, json_model_override_args=args.json_model_override_args)
        cfg = json.loads((Path(args.tp_model_path) / "config.json").read_text())
    else:
        cfg = dict(TINY if args.quick else LLAMA3_8B)
        cfg["max_position_embeddings"] = max(max(args.contexts) + WINDOW_HEADROOM * args.decode_steps + 64,
                                             cfg["max_position_embeddings"])
        model = dict(model_path=write_config(cfg), load_format="dummy", skip_tokenizer_init=True,
                     context_length=cfg["max_position_embeddings"])
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "config": args.tp_model_path or ("tiny" if args.quick else "llama3-8b-dummy"), "cases": []}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem_bytes = 4 if dtype in ("float32", "fp32", "float") else 2
    token_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem_bytes
    for context in args.contexts:
        per_request = context + WINDOW_HEADROOM * args.decode_steps + args.tp_draft + 4
        device_tokens = args.max_total_tokens or args.batch * per_request
        # Host-tier modes get the same KV memory: a share for staging verification layers, the rest for drafts.
        staging_tokens = int(device_tokens * args.tp_staging_share)
        staging = dict(vericache_staging_gb=staging_tokens * token_bytes / 2**30)
        host_batch = min(args.host_batch, int(args.host_mem_gb * 2**30 // (token_bytes * per_request)))
        prompts = _throughput_prompts(args, model, cfg, context, max(host_batch, args.batch))
        # (name, compressor, full KV, batch, draft length, groups). full_kv_host is full-KV decoding of the host
        # batch with its KV in host memory (VeriCache with no drafts: every step streams the whole KV), the
        # baseline that serves the batch VeriCache's host mode serves within the same KV memory.
        modes = [("full_kv", None, None, args.batch, 0, 1), ("full_kv_host", None, "host", host_batch, 0, 1)]
        for c in args.tp_compressors:
            modes += [("vericache_gpu", c, "gpu", args.batch, args.tp_draft, 1),
                      ("vericache_host", c, "host", host_batch, args.tp_draft, 1)]
            if args.stagger_groups > 1:
                modes.append(("vericache_host_staggered", c, "host", host_batch, args.tp_draft, args.stagger_groups))
        outputs: dict[str, list[list[int]]] = {}
        for name, compressor, full_kv, batch, draft, groups in modes:
            if args.modes and name not in args.modes:
                continue
            spec = {} if full_kv is None else dict(
                speculative_algorithm="vericache", vericache_full_kv=full_kv, vericache_budget=args.tp_budget,
                speculative_num_draft_tokens=draft, vericache_compressor=compressor or "streaming",
                vericache_stagger_groups=groups, **(staging if full_kv == "host" else {}))
            pool_tokens = device_tokens - (staging_tokens if full_kv == "host" else 0)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            held_before = torch.cuda.memory_allocated() if device == "cuda" else None
            engine = Engine(**model, disable_radix_cache=True, max_total_tokens=pool_tokens, schedule_policy="fcfs",
                            dtype=dtype, **spec)
            case, output_ids = _decode_case(engine, args, prompts[:batch], accept_lengths)
            reference = outputs.get("full_kv_host" if full_kv == "host" else "full_kv")
            if args.tp_model_path and draft and reference is not None:
                case["identical_requests"] = sum(a == b for a, b in zip(output_ids, reference)) / batch
            outputs.setdefault(name, output_ids)
            if args.tp_model_path:
                case["output_ids"] = output_ids
            case.update(mode=name, compressor=compressor, context=context, device_kv_tokens=device_tokens,
                        pool_tokens=pool_tokens, staging_gb=spec.get("vericache_staging_gb"),
                        peak_device_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
                        held_before_bytes=held_before)
            result["cases"].append(case)
            print(f"(b) {name:24s} {compressor or '':9s} ctx={context:<7d} batch={batch:<3d} "
                  f"{case['decode_tokens_per_s']:.1f} tok/s"
                  + (f" round={case['round_s'] * 1e3:.1f}ms accept_len={case['spec']['accept_length']:.2f}"
                     f" identical={case.get('identical_requests')} projected={case.get('projected_tokens_per_s')}"
                     if draft else ""), flush=True)
            engine.shutdown()
            del engine
            gc.collect()  # the engine's pools sit in reference cycles (graph runners hold their model runner)
            if device == "cuda":
                torch.cuda.empty_cache()
    return result


def _throughput_prompts(args, model: dict, cfg: dict, context: int, n: int) -> list[list[int]]:
    """Random ids for dummy weights; for a real model, (a)'s code and retrieval prompts of about `context` tokens."""
    if not args.tp_model_path:
        return rand_prompts(n, context, cfg["vocab_size"], context)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model["model_path"])
    code = code_prompts(tokenizer, n // 2, context)
    retrieval = retrieval_prompts(tokenizer, n - len(code), context)
    mixed = [p for pair in zip_longest(code, retrieval) for p in pair if p is not None]
    return [p.ids for p in mixed]


def _decode_case(engine: Engine, args, prompts: list[list[int]], accept_lengths: list[float]) -> tuple[dict, list]:
    """Steady-state decode of the whole batch. The clock starts once every request has finished prefill and its
    first decode step or round (host-tier adoption, first draft build) and stops once each has output
    --decode-steps more tokens: requests that prefill one after another (a device pool too small for them all at
    once) decode in a batch that lacks the later ones until then, and finished ones would leave it shrinking."""
    vocab = engine.model_config.vocab_size
    engine.generate(input_ids=rand_prompts(1, 64, vocab, 1), sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    params = {"max_new_tokens": WINDOW_HEADROOM * args.decode_steps, "temperature": 0, "ignore_eos": True}
    reqs = submit(engine, prompts, params)
    prefill = timed(lambda: step_until(engine, lambda: all(len(r.output_ids) >= 2 for r in reqs)))
    worker = engine.scheduler.spec_worker
    if worker is not None:
        worker.stats.__init__()
    start = [len(r.output_ids) for r in reqs]

    def window_done() -> bool:
        progress = [len(r.output_ids) - s for r, s in zip(reqs, start)]
        return min(progress) >= args.decode_steps or any(r.finished() for r in reqs)

    decode_s = timed(lambda: step_until(engine, window_done))
    tokens = sum(len(r.output_ids) - s for r, s in zip(reqs, start))
    complete = all(len(r.output_ids) - s >= args.decode_steps for r, s in zip(reqs, start))
    for r in reqs:
        if not r.finished():
            engine.scheduler.abort_request(r.rid)
    case = {"batch": len(prompts), "prompt_tokens": sum(map(len, prompts)) / len(prompts), "full_window": complete,
            "decode_steps": args.decode_steps, "prefill_s": prefill, "decode_s": decode_s,
            "decode_tokens": tokens, "decode_tokens_per_s": tokens / decode_s,
            "retractions": engine.scheduler.stats.num_retractions}
    if worker is not None and worker.num_draft:
        stats = worker.stats.to_dict()
        round_s = decode_s / max(stats["rounds"], 1)
        requests_per_round = stats["verify_ct"] / max(stats["rounds"], 1)
        case.update(spec=stats, round_s=round_s, draft_share=stats["draft_time_s"] / decode_s,
            requests_per_round=requests_per_round)
        if accept_lengths:
            case["projected_tokens_per_s"] = {f"{a:g}": requests_per_round * a / round_s for a in accept_lengths}
    return case, [r.output_ids[: args.decode_steps + 2] for r in reqs]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    parts = _strs(args.parts)
    result: dict = {"args": args_json(args)}
    accept_lengths = list(args.assume_accept_length or [])
    if "acceptance" in parts:
        result["acceptance"] = bench_acceptance(args)
        if not accept_lengths:
            accept_lengths = sorted({round(r["accept_length"], 2) for r in result["acceptance"]["runs"]})
    if "throughput" in parts:
        result["throughput"] = bench_throughput(args, accept_lengths or [1.0, 2.0, 4.0])
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
