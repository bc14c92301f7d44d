"""Span quality at full size: how far answers move when each document is prefilled as a span instead of with dense
attention, per task and mode, written as JSON and a PNG (the frontier: accuracy against the share of span tokens
recomputed, a line per task and their mean; then each task's accuracy against prefill tokens computed).

The modes, the runner and the scoring are sglang_pic/span_quality/ (modes.py says what each mode means, scoring.py
what each reported field means); `python -m sglang_pic.check_span_quality` is the quick version of this run for a
user's model. The tasks are span_quality_tasks.py: the package's plus rag_two_hop over rag_workload.py. Choose
settings on `--split tuning`, report them on `--split heldout` (the default): the two draw from disjoint seeds.

Usage: python benchmark/bench_span_quality.py --samples 30 --split tuning
       python benchmark/bench_span_quality.py --device cuda --dtype bfloat16 --samples 300
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from span_quality_tasks import TASKS, BenchTaskSizes  # noqa: E402

from sglang_pic.model_loader.loader import model_dirs  # noqa: E402
from sglang_pic.span_quality.items import SPLITS  # noqa: E402
from sglang_pic.span_quality.modes import BASELINE, MODES, REFERENCE, with_adapter  # noqa: E402
from sglang_pic.span_quality.prompts import PromptBuilder, Workload  # noqa: E402
from sglang_pic.span_quality.runner import ModeRun, Progress, RunConfig, run_modes  # noqa: E402
from sglang_pic.span_quality.scoring import (  # noqa: E402
    TaskModeResult,
    mean_over_tasks,
    reference_topk_mass,
    results,
)
from sglang_pic.span_quality.sizes import add_size_flags, sizes_from_flags  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODES = ("dense", "naive", "anchor", "head8", "anchor+head8", "anchor+head32", "anchor+seams16")
MEAN_FIELDS = ("accuracy", "agreement_with_dense", "first_token_top1_agreement", "first_token_kl",
               "recomputed_span_share", "computed_prefill_tokens_per_request", "extra_prefill_tokens_per_request")


class BarProgress(Progress):
    """A tqdm bar over every request of every mode."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, unit="req")

    def task_starting(self, mode: str, task: str) -> None:
        self.bar.set_description(f"{mode}/{task}")

    def requests_done(self, n: int) -> None:
        self.bar.update(n)


# ---- output ---------------------------------------------------------------------------------------------------------
def means(results: dict[str, dict[str, TaskModeResult]]) -> dict[str, dict[str, float | None]]:
    """mode -> MEAN_FIELDS averaged over the tasks."""
    modes = next(iter(results.values()))
    return {m: {f: mean_over_tasks(results, m, f) for f in MEAN_FIELDS} for m in modes}


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: dict[str, dict[str, TaskModeResult]]) -> None:
    head = f"{'task':<15} {'mode':<15} {'acc':>6} {'agree':>6} {'top1':>6} {'KL':>8} {'recomp':>6} {'prompt':>7} " \
           f"{'computed':>9} {'extra':>8} {'wall s':>7}"
    print(head)
    print("-" * len(head))
    for task, by_mode in results.items():
        for mode, r in by_mode.items():
            print(f"{task:<15} {mode:<15} {_num(r.accuracy, '.3f'):>6} {_num(r.agreement_with_dense, '.3f'):>6} "
                  f"{_num(r.first_token_top1_agreement, '.3f'):>6} {_num(r.first_token_kl, '.4f'):>8} "
                  f"{r.recomputed_span_share:>6.3f} {r.prompt_tokens_per_request:>7.0f} "
                  f"{r.computed_prefill_tokens_per_request:>9.1f} {_num(r.extra_prefill_tokens_per_request, '.1f'):>8} "
                  f"{r.wall_s:>7.1f}")
            if r.accuracy_by_depth:
                depth = "  ".join(f"{b}: {a:.2f}" for b, a in r.accuracy_by_depth.items())
                print(f"{'':<15} {'':<15} accuracy by depth of the fact  {depth}")
    print("-" * len(head))
    for mode, m in means(results).items():
        print(f"{'mean':<15} {mode:<15} {_num(m['accuracy'], '.3f'):>6} {_num(m['agreement_with_dense'], '.3f'):>6} "
              f"{_num(m['first_token_top1_agreement'], '.3f'):>6} {_num(m['first_token_kl'], '.4f'):>8} "
              f"{_num(m['recomputed_span_share'], '.3f'):>6} {'':>7} "
              f"{_num(m['computed_prefill_tokens_per_request'], '.1f'):>9} "
              f"{_num(m['extra_prefill_tokens_per_request'], '.1f'):>8}")


def _frontier(ax, results: dict[str, dict[str, TaskModeResult]]) -> None:
    """Accuracy against the share of span tokens recomputed: a line per task through its modes, and the mean."""
    for task, by_mode in results.items():
        points = sorted((r.recomputed_span_share, r.accuracy) for r in by_mode.values())
        ax.plot(*zip(*points), marker="o", ms=3, lw=1, alpha=0.6, label=task)
    points = sorted((m["recomputed_span_share"], m["accuracy"], mode) for mode, m in means(results).items())
    ax.plot([x for x, _, _ in points], [y for _, y, _ in points], "k-o", lw=2.2, ms=5, label="mean over tasks")
    for x, y, mode in points:
        ax.annotate(mode, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_title("accuracy against the share of span tokens recomputed (dense: 1)", fontsize=10)
    ax.set_xlabel("recomputed span tokens / span tokens")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def plot(results: dict[str, dict[str, TaskModeResult]], path: Path) -> None:
    """The frontier on top (two panels wide, its legend beside it), then each task's accuracy against the prefill
    tokens a request computes, four a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = 1 + -(-len(results) // cols)
    fig = plt.figure(figsize=(4.2 * cols, 3.8 * rows))
    grid = fig.add_gridspec(rows, cols)
    frontier = fig.add_subplot(grid[0, :2])
    _frontier(frontier, results)
    panels = [frontier]
    for i, (task, by_mode) in enumerate(results.items()):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols])
        for mode, r in by_mode.items():
            x = r.computed_prefill_tokens_per_request
            ax.scatter([x], [r.accuracy], s=40)
            ax.annotate(mode, (x, r.accuracy), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("computed prefill tokens / request")
        panels.append(ax)
    for ax in panels:
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
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
    p.add_argument("--span-adapter", help="span adapter folder the +adapter modes serve")
    p.add_argument("--span-adapter-scope", default="spans", choices=("spans", "all"),
                   help="how the +adapter modes serve it: on span requests' rows only, or merged (all)")
    p.add_argument("--samples", type=int, default=8, help="samples per task")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated names from the MODES table: {', '.join(MODES)}")
    p.add_argument("--batch-size", type=int, default=16, help="requests per Engine.generate call")
    p.add_argument("--kl-top-k", type=int, default=20, help="dense first tokens the KL is taken over")
    p.add_argument("--examples", type=int, default=3, help="replies kept in the JSON per task and mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="heldout", choices=SPLITS,
                   help="which seeds draw the items: tuning (to choose settings on) or heldout (to report them)")
    add_size_flags(p, BenchTaskSizes)
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
    if args.samples < 1 or args.batch_size < 1 or args.kl_top_k < 1:
        p.error("--samples, --batch-size and --kl-top-k must be positive")
    if REFERENCE in args.modes:  # the others ask for their logprobs of the reference's top first tokens
        args.modes.remove(REFERENCE)
        args.modes.insert(0, REFERENCE)
    try:
        args.run_modes = {m: with_adapter(MODES[m], args.span_adapter, args.span_adapter_scope) for m in args.modes}
    except ValueError as e:
        p.error(str(e))
    args.sizes = sizes_from_flags(p, args, BenchTaskSizes)
    args.output = args.output or RESULTS / f"span_quality_{args.device}.json"
    return args


def engine_kwargs(args: argparse.Namespace, model_dir: str, tokenizer_dir: str) -> dict[str, Any]:
    kwargs = dict(model_path=model_dir, tokenizer_path=tokenizer_dir, load_format=args.load_format,
                  dtype=args.dtype, device=args.device, chat_template=args.chat_template, random_seed=args.seed)
    if args.max_total_tokens is not None:
        kwargs["max_total_tokens"] = args.max_total_tokens
    return kwargs


def mode_info(name: str, run: ModeRun) -> dict[str, Any]:
    return {
        **asdict(MODES[name]), "engine_start_s": run.engine_start_s, "wall_s": sum(run.walls.values()),
        "computed_prefill_tokens": run.computed_prefill_tokens, "reused_prefill_tokens": run.reused_prefill_tokens,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir, tokenizer_dir = model_dirs(args.model_path, args.tokenizer_path, args.load_format)
    builder = PromptBuilder(model_dir, tokenizer_dir, args.chat_template)
    workload = Workload.build({t: TASKS[t] for t in args.tasks}, args.samples, args.seed, args.sizes, builder,
                              args.split)
    progress = BarProgress(len(args.modes) * workload.requests())
    runs = run_modes(args.run_modes, workload, builder,
                     engine_kwargs(args, model_dir, tokenizer_dir), RunConfig(args.batch_size, args.kl_top_k), progress)
    progress.bar.close()
    scores = results(runs, workload, args.examples)
    out = {
        "config": {
            "model_path": model_dir, "span_adapter": args.span_adapter,
            "span_adapter_scope": args.span_adapter_scope, "device": args.device, "dtype": args.dtype,
            "samples": args.samples,
            "seed": args.seed, "split": workload.split, "batch_size": args.batch_size, "kl_top_k": args.kl_top_k,
            "sizes": asdict(args.sizes), "reference": REFERENCE, "baseline": BASELINE,
        },
        "modes": {name: mode_info(name, run) for name, run in runs.items()},
        "tasks": {
            t: {
                "max_new_tokens": TASKS[t].max_new_tokens,
                "plain_ids_match": sum(p.plain_ids_match for p in workload.prompts[t]) / len(workload.prompts[t]),
                "reference_topk_mass": reference_topk_mass(runs, t),
            }
            for t in args.tasks
        },
        "results": {t: {m: asdict(r) for m, r in by_mode.items()} for t, by_mode in scores.items()},
        "mean_over_tasks": means(scores),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    plot(scores, args.output.with_suffix(".png"))
    print_table(scores)
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()
