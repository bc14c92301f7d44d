"""Span quality: how far answers move when each document is prefilled as a span instead of with dense attention.

Every task (span_quality_tasks.py) is rendered once through the server's own chat rendering (OpenAIServing
.render_chat, tools as spans as with `tool_spans: true`) and tokenized by the engine's segmenter. A mode says how
the prompt is sent and which Engine settings serve it:
  dense         the prompt's token ids with the markers dropped (the same ids the spans have), full attention;
  naive         the marked prompt: each document a span prefilled on its own (span_anchor none);
  anchor        spans prefilled behind the model's anchor (span_anchor auto, span_policy.py);
  headK         each request recomputes every span's first K tokens with full attention;
  anchor+headK  both.
A mode is its marking plus the Engine kwargs that switch its mechanism on.

Each mode runs every task through one Engine built once (its cache shared across the samples, as in real use),
greedy, in batches. Reported per task and mode: accuracy against the gold answers; agreement with the dense
answers (same key: the gold/rival phrases said, in order, or the canonical tool call); the first token's top-1
agreement with dense and KL(dense || mode) of its distribution; computed prefill tokens per request and the extra
over naive spans; wall time. The KL is over dense's top-K first tokens plus one bucket for the rest of the
vocabulary (each mode returns its logprobs of those ids via token_ids_logprob): a lower bound on the full KL that
is exact when the top K hold all of dense's mass (`reference_topk_mass` says how much they hold).

Usage: python benchmark/bench_span_quality.py --samples 30
       python benchmark/bench_span_quality.py --device cuda --dtype bfloat16 --samples 300
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from bench_rag_spans import resolve_paths  # noqa: E402
from span_quality_tasks import TASKS, Item, TaskSizes, judge  # noqa: E402

from sglang_pic import Engine  # noqa: E402
from sglang_pic.entrypoints.openai_api import OpenAIServing  # noqa: E402
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest  # noqa: E402
from sglang_pic.frontend_lang import strip_markers  # noqa: E402
from sglang_pic.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang_pic.model_config import ModelConfig  # noqa: E402
from sglang_pic.server_args import ServerArgs  # noqa: E402
from sglang_pic.tokenizer import load_tokenizer  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Mode:
    marking: str  # "dense": the prompt's ids without markers; "spans": the marked prompt
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


MARKINGS = ("dense", "spans")


def _spans(anchor: str, head: int) -> Mode:
    return Mode("spans", {"span_anchor": anchor, "span_head_tokens": head})


MODES: dict[str, Mode] = {
    "dense": Mode("dense"),
    "naive": _spans("none", 0),
    "anchor": _spans("auto", 0),
    **{f"head{k}": _spans("none", k) for k in (8, 32)},
    **{f"anchor+head{k}": _spans("auto", k) for k in (4, 8, 16, 32, 64)},
}
DEFAULT_MODES = ("dense", "naive", "anchor", "head8", "anchor+head8", "anchor+head32")
REFERENCE = "dense"  # the answers and first-token distributions the other modes are compared with
BASELINE = "naive"  # extra prefill tokens are counted over this mode's


@dataclass(frozen=True)
class Prompt:
    marked: str  # the rendered chat prompt, documents (and tools) marked as spans
    ids: list[int]  # the engine's token ids for it: the dense prompt
    plain_ids_match: bool  # whether tokenizing strip_markers(marked) whole gives `ids` too


@dataclass
class Record:
    """One request's outcome in one mode."""

    reply: str
    correct: bool
    key: str
    first_token: int
    first_logprobs: dict[int, float]  # over the reference's top-K first tokens (the reference: its own top K)
    prompt_tokens: int
    computed_tokens: int


@dataclass
class TaskModeResult:
    samples: int
    accuracy: float
    agreement_with_dense: float | None
    first_token_top1_agreement: float | None
    first_token_kl: float | None
    prompt_tokens_per_request: float
    computed_prefill_tokens_per_request: float
    extra_prefill_tokens_per_request: float | None
    wall_s: float
    accuracy_by_depth: dict[str, float] | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)


# ---- prompts ----------------------------------------------------------------------------------------------------
class PromptBuilder:
    """Renders items as the server's chat route does and tokenizes them as the engine does, without a model."""

    def __init__(self, model_dir: str, tokenizer_dir: str, chat_template: str | None) -> None:
        args = ServerArgs.from_kwargs(model_path=model_dir, tokenizer_path=tokenizer_dir, chat_template=chat_template)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        config = ModelConfig.from_server_args(model_dir, args, device="cpu")
        self.tokenizer_manager = TokenizerManager(args, self.tokenizer, config)
        manager = SimpleNamespace(tokenizer=self.tokenizer, server_args=args, model_config=config,
                                  files=SimpleNamespace(model_dir=model_dir))
        self.serving = OpenAIServing(manager)
        self.tool_parser = self.serving.tool_parser

    def build(self, item: Item) -> Prompt:
        body = ChatCompletionRequest(
            messages=[{"role": "system", "content": item.system}, {"role": "user", "content": item.user}],
            tools=list(item.tools) or None,
            tool_spans=bool(item.tools),
        )
        marked = self.serving.render_chat(body)
        ids = [t for seg in self.tokenizer_manager.tokenize(marked) for t in seg.token_ids]
        plain = self.tokenizer(strip_markers(marked), add_special_tokens=True)["input_ids"]
        return Prompt(marked, ids, list(plain) == ids)

    def tool_calls(self, item: Item, reply: str) -> list:
        if not item.tools or self.tool_parser is None:
            return []
        return self.tool_parser.parse(reply, {t["function"]["name"] for t in item.tools})[1]


# ---- running ------------------------------------------------------------------------------------------------------
def _first_logprobs(meta: dict[str, Any], asked: bool) -> dict[int, float]:
    row = meta["output_token_ids_logprobs" if asked else "output_top_logprobs"][0]
    return {tok: lp for lp, tok, _ in row}


def run_task(
    engine: Engine, mode: Mode, builder: PromptBuilder, items: list[Item], prompts: list[Prompt],
    max_new_tokens: int, reference: list[Record] | None, args: argparse.Namespace, bar: tqdm,
) -> tuple[list[Record], float]:
    """Every item through `engine` in batches; (records, wall seconds)."""
    records: list[Record] = []
    wall = 0.0
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    for lo in range(0, len(items), args.batch_size):
        batch = prompts[lo : lo + args.batch_size]
        logprobs: dict[str, Any] = {"return_logprob": True}
        if reference is None:
            logprobs["top_logprobs_num"] = args.kl_top_k
        else:
            logprobs["token_ids_logprob"] = [sorted(r.first_logprobs) for r in reference[lo : lo + len(batch)]]
        if mode.marking == "dense":
            request = {"input_ids": [p.ids for p in batch]}
        else:
            request = {"prompt": [p.marked for p in batch]}
        start = time.perf_counter()
        outs = engine.generate(sampling_params=params, **request, **logprobs)
        wall += time.perf_counter() - start
        for item, prompt, out in zip(items[lo : lo + len(batch)], batch, outs):
            meta = out["meta_info"]
            if meta["prompt_tokens"] != len(prompt.ids):
                raise RuntimeError(f"the engine ran {meta['prompt_tokens']} prompt tokens, the dense prompt has "
                                   f"{len(prompt.ids)}: the modes would not see the same tokens")
            right, key = judge(item.gold, out["text"], builder.tool_calls(item, out["text"]))
            records.append(Record(
                reply=out["text"], correct=right, key=key, first_token=out["output_ids"][0],
                first_logprobs=_first_logprobs(meta, reference is not None),
                prompt_tokens=meta["prompt_tokens"], computed_tokens=meta["prompt_tokens"] - meta["cached_tokens"],
            ))
        bar.update(len(batch))
    return records, wall


def first_token_kl(ref: dict[int, float], other: dict[int, float]) -> float:
    """KL(ref || other) over ref's top-K ids plus one bucket for the rest of the vocabulary."""
    p = np.exp(np.array([ref[t] for t in sorted(ref)]))
    q = np.exp(np.array([other[t] for t in sorted(ref)]))
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-12)
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-30)) - np.log(np.maximum(q, 1e-30)))))
    return max(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0), 0.0)


def summarize(
    records: list[Record], items: list[Item], wall: float, reference: list[Record] | None,
    baseline: list[Record] | None, examples: int,
) -> TaskModeResult:
    def mean(values: list) -> float:
        return float(np.mean(values)) if values else float("nan")

    computed = mean([r.computed_tokens for r in records])
    result = TaskModeResult(
        samples=len(records),
        accuracy=mean([r.correct for r in records]),
        agreement_with_dense=None,
        first_token_top1_agreement=None,
        first_token_kl=None,
        prompt_tokens_per_request=mean([r.prompt_tokens for r in records]),
        computed_prefill_tokens_per_request=computed,
        extra_prefill_tokens_per_request=(
            computed - mean([r.computed_tokens for r in baseline]) if baseline is not None else None
        ),
        wall_s=wall,
        examples=[{"reply": r.reply, "gold": asdict(i.gold), "correct": r.correct}
                  for r, i in zip(records[:examples], items)],
    )
    if reference is not None:
        result.agreement_with_dense = mean([r.key == d.key for r, d in zip(records, reference)])
        result.first_token_top1_agreement = mean([r.first_token == d.first_token for r, d in zip(records, reference)])
        result.first_token_kl = mean([first_token_kl(d.first_logprobs, r.first_logprobs)
                                      for r, d in zip(records, reference)])
    buckets = sorted({i.bucket for i in items if i.bucket is not None}, key=lambda b: int(b.split("-")[0]))
    if buckets:
        result.accuracy_by_depth = {
            b: mean([r.correct for r, i in zip(records, items) if i.bucket == b]) for b in buckets
        }
    return result


def engine_kwargs(args: argparse.Namespace, model_dir: str, tokenizer_dir: str, mode: Mode) -> dict[str, Any]:
    kwargs = dict(model_path=model_dir, tokenizer_path=tokenizer_dir, load_format=args.load_format,
                  dtype=args.dtype, device=args.device, chat_template=args.chat_template, random_seed=args.seed)
    if args.max_total_tokens is not None:
        kwargs["max_total_tokens"] = args.max_total_tokens
    return {**kwargs, **mode.engine_kwargs}


# ---- output ---------------------------------------------------------------------------------------------------------
def print_table(results: dict[str, dict[str, TaskModeResult]]) -> None:
    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = f"{'task':<15} {'mode':<12} {'acc':>6} {'agree':>6} {'top1':>6} {'KL':>8} {'prompt':>7} " \
           f"{'computed':>9} {'extra':>8} {'wall s':>7}"
    print(head)
    print("-" * len(head))
    for task, by_mode in results.items():
        for mode, r in by_mode.items():
            print(f"{task:<15} {mode:<12} {num(r.accuracy, '.3f'):>6} {num(r.agreement_with_dense, '.3f'):>6} "
                  f"{num(r.first_token_top1_agreement, '.3f'):>6} {num(r.first_token_kl, '.4f'):>8} "
                  f"{r.prompt_tokens_per_request:>7.0f} {r.computed_prefill_tokens_per_request:>9.1f} "
                  f"{num(r.extra_prefill_tokens_per_request, '.1f'):>8} {r.wall_s:>7.1f}")
            if r.accuracy_by_depth:
                depth = "  ".join(f"{b}: {a:.2f}" for b, a in r.accuracy_by_depth.items())
                print(f"{'':<15} {'':<12} accuracy by needle depth  {depth}")


def plot(results: dict[str, dict[str, TaskModeResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.8), squeeze=False)
    for ax, (task, by_mode) in zip(axes[0], results.items()):
        for mode, r in by_mode.items():
            x = r.extra_prefill_tokens_per_request or 0.0
            ax.scatter([x], [r.accuracy], s=40)
            ax.annotate(mode, (x, r.accuracy), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("extra prefill tokens / request over naive")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="HF folder or .gguf; default: the embedded Qwen2.5-Coder-0.5B-Instruct")
    p.add_argument("--tokenizer-path")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy", "gguf"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--chat-template", help="as the server's --chat-template (default: the tokenizer's)")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens")
    p.add_argument("--samples", type=int, default=8, help="samples per task")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated names from the MODES table: {', '.join(MODES)}")
    p.add_argument("--batch-size", type=int, default=16, help="requests per Engine.generate call")
    p.add_argument("--kl-top-k", type=int, default=20, help="dense first tokens the KL is taken over")
    p.add_argument("--examples", type=int, default=3, help="replies kept in the JSON per task and mode")
    p.add_argument("--seed", type=int, default=0)
    for f in fields(TaskSizes):
        kind = (lambda s: tuple(int(x) for x in s.split(","))) if isinstance(f.default, tuple) else int
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                       help="task size" + (" (min,max)" if isinstance(f.default, tuple) else ""))
    p.add_argument("--output", type=Path, help="JSON path (default: benchmark/results/span_quality_<device>.json); "
                                               "the PNG is written beside it")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    for name, given, known in (("tasks", args.tasks, TASKS), ("modes", args.modes, MODES)):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            p.error(f"unknown or no {name} {unknown}; choose from {', '.join(known)}")
    if len(set(args.modes)) < len(args.modes):
        p.error("--modes names a mode twice")
    bad = [m for m in args.modes if MODES[m].marking not in MARKINGS]
    if bad:
        p.error(f"modes {bad} have a marking outside {MARKINGS}")
    if args.samples < 1 or args.batch_size < 1 or args.kl_top_k < 1:
        p.error("--samples, --batch-size and --kl-top-k must be positive")
    if REFERENCE in args.modes:  # the others ask for their logprobs of the reference's top first tokens
        args.modes.remove(REFERENCE)
        args.modes.insert(0, REFERENCE)
    try:
        args.sizes = TaskSizes(**{f.name: getattr(args, f.name) for f in fields(TaskSizes)})
    except ValueError as e:
        p.error(str(e))
    args.output = args.output or RESULTS / f"span_quality_{args.device}.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir, tokenizer_dir = resolve_paths(args)
    sizes = args.sizes
    builder = PromptBuilder(model_dir, tokenizer_dir, args.chat_template)

    def count(text: str) -> int:
        return len(builder.tokenizer.encode(text, add_special_tokens=False))

    items = {t: TASKS[t].make(args.samples, args.seed * 100 + i, sizes, count) for i, t in enumerate(args.tasks)}
    prompts = {t: [builder.build(it) for it in items[t]] for t in args.tasks}

    records: dict[str, dict[str, list[Record]]] = {t: {} for t in args.tasks}
    walls: dict[str, dict[str, float]] = {t: {} for t in args.tasks}
    mode_info: dict[str, dict[str, Any]] = {}
    bar = tqdm(total=len(args.modes) * sum(len(v) for v in items.values()), unit="req")
    for name in args.modes:
        mode = MODES[name]
        start = time.perf_counter()
        with Engine(**engine_kwargs(args, model_dir, tokenizer_dir, mode)) as engine:
            built = time.perf_counter()
            for t in args.tasks:
                bar.set_description(f"{name}/{t}")
                reference = records[t].get(REFERENCE)
                records[t][name], walls[t][name] = run_task(
                    engine, mode, builder, items[t], prompts[t], TASKS[t].max_new_tokens, reference, args, bar
                )
            stats = engine.get_stats()
        mode_info[name] = {
            **asdict(mode), "engine_start_s": built - start, "wall_s": sum(walls[t][name] for t in args.tasks),
            "computed_prefill_tokens": stats["computed_prefill_tokens"],
            "reused_prefill_tokens": stats["reused_prefill_tokens"],
        }
    bar.close()

    results = {
        t: {
            m: summarize(records[t][m], items[t], walls[t][m], records[t].get(REFERENCE), records[t].get(BASELINE),
                         args.examples)
            for m in args.modes
        }
        for t in args.tasks
    }
    ref_masses = {
        t: float(np.mean([np.exp(list(r.first_logprobs.values())).sum() for r in records[t][REFERENCE]]))
        for t in args.tasks if REFERENCE in records[t]
    }
    out = {
        "config": {
            "model_path": model_dir, "device": args.device, "dtype": args.dtype, "samples": args.samples,
            "seed": args.seed, "batch_size": args.batch_size, "kl_top_k": args.kl_top_k, "sizes": asdict(sizes),
            "reference": REFERENCE, "baseline": BASELINE,
        },
        "modes": mode_info,
        "tasks": {
            t: {
                "max_new_tokens": TASKS[t].max_new_tokens,
                "plain_ids_match": float(np.mean([p.plain_ids_match for p in prompts[t]])),
                "reference_topk_mass": ref_masses.get(t),
            }
            for t in args.tasks
        },
        "results": {t: {m: asdict(r) for m, r in by_mode.items()} for t, by_mode in results.items()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    plot(results, args.output.with_suffix(".png"))
    print_table(results)
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()
