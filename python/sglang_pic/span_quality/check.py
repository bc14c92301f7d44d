"""`python -m sglang_pic.check_span_quality --model-path M`: a quick span-quality run on your own model.

Spans trade answer quality for prefill work, and how much depends on the model. This runs the package's tasks
(tasks.py: factual QA, tool selection, needle, late record fields, code retrieval, long spans, a multi-turn chat)
with dense attention and with spans under each setting: isolated (`--span-anchor none`), anchored with each K of
--head-tokens (`--span-anchor auto --span-head-tokens K`, K = 0 being the anchor alone), anchored with each K of
--seam-tokens (head and tail of K each: `--span-tail-tokens K` too) and anchored with each share of --lexical-shares
(`--span-query-share F --span-select lexical`). Per task and setting it prints the accuracy, how often the answer
agrees with dense attention's, how often the first token does, the share of span tokens recomputed, and how many
more prefill tokens a request computes than with isolated spans. It recommends a setting by recommend.RULE, with the
server flags that select it.

The recommendation is chosen on the tuning split's items and then reported on held-out items (seeds disjoint from
the tuning ones), run with dense attention, isolated spans and the recommended setting only: the held-out numbers
say how well the choice carries over to items it was not chosen on. The full-size run with KL, accuracy by depth,
a RAG task and the frontier plot is benchmark/bench_span_quality.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sglang_pic.model_loader.loader import model_dirs
from sglang_pic.span_quality.items import SPLITS
from sglang_pic.span_quality.modes import BASELINE, REFERENCE, Mode
from sglang_pic.span_quality.prompts import PromptBuilder, Workload
from sglang_pic.span_quality.recommend import RULE, Recommendation, SettingScore, recommend, setting_scores, settings
from sglang_pic.span_quality.runner import ModeRun, Progress, RunConfig, run_modes
from sglang_pic.span_quality.scoring import TaskModeResult, mean_over_tasks, results
from sglang_pic.span_quality.sizes import TaskSizes, add_size_flags, sizes_from_flags
from sglang_pic.span_quality.tasks import TASKS

DESCRIPTION = (
    "A quick span-quality run on your own model: every task with dense attention and with spans under each setting "
    "tried (isolated, the anchor with each --head-tokens and --seam-tokens length and each --lexical-shares "
    "share), a row per task and setting. It recommends the cheapest setting whose accuracy on every task stays "
    "within --tolerance of dense attention's (else the closest one), chosen on tuning items and reported on "
    "held-out items, with the server flags that select it."
)
RUN_TIME = (
    "Run time on a CPU: the defaults send 616 requests (7 tasks x 8 items through 8 settings on the tuning items "
    "and 3 on the held-out ones). On 2 CPU cores with the embedded 0.5B model, --samples 1 took 84 minutes while "
    "other jobs shared the cores (59 minutes of CPU time, 10 GB of memory at peak), so the defaults take an "
    "estimated 4 to 11 hours, about half of it long_spans' prompts of 6-10K tokens. For a first look use --samples "
    "1 or 2 and leave long_spans out of --tasks."
)


class _Printer(Progress):
    """Says what runs before each long step: an Engine start loads the model."""

    def __init__(self, modes: dict[str, Mode], workload: Workload) -> None:
        self.modes = modes
        self.workload = workload

    def engine_starting(self, mode: str, index: int, total: int) -> None:
        print(f"[{index + 1}/{total}] {mode} ({self.modes[mode].server_flags()}): starting an engine "
              "(loads the model) ...", flush=True)

    def task_starting(self, mode: str, task: str) -> None:
        print(f"      {task}: {len(self.workload.items[task])} requests", flush=True)

    def mode_done(self, mode: str, run: ModeRun) -> None:
        print(f"      done: engine start {run.engine_start_s:.1f} s, requests {sum(run.walls.values()):.1f} s",
              flush=True)


def print_table(title: str, scores: dict[str, dict[str, TaskModeResult]], per_setting: list[SettingScore]) -> None:
    """A row per task and setting, then each setting's means over the tasks with its server flags."""
    head = f"{'task':<15} {'setting':<15} {'accuracy':>8} {'agree':>6} {'top1':>6} {'recomp':>6} {'extra tok/req':>13}"
    print()
    print(title)
    print(head)
    print("-" * len(head))
    for task, by_mode in scores.items():
        for name, r in by_mode.items():
            print(f"{task:<15} {name:<15} {r.accuracy:>8.2f} {r.agreement_with_dense:>6.2f} "
                  f"{r.first_token_top1_agreement:>6.2f} {r.recomputed_span_share:>6.2f} "
                  f"{r.extra_prefill_tokens_per_request:>13.1f}")
    print("-" * len(head))
    for s in per_setting:
        print(f"{'mean':<15} {s.name:<15} {s.accuracy:>8.2f} {s.agreement:>6.2f} {s.top1:>6.2f} "
              f"{s.recomputed_share:>6.2f} {s.extra_tokens:>13.1f}   {s.mode.server_flags()}")


def print_choice(pick: SettingScore, tolerance: float) -> None:
    print()
    print(f"rule: {RULE.format(tol=tolerance)}")
    print(f"recommended: {pick.name}: agreement with dense {pick.agreement:.2f} on the tuning items, its worst task "
          f"{pick.worst_gap:.2f} below dense, {pick.extra_tokens:.1f} extra prefill tokens per request over isolated "
          "spans")


def print_heldout(pick: SettingScore, heldout: SettingScore, dense_accuracy: float) -> None:
    print()
    print(f"held out: {pick.name}: agreement with dense {heldout.agreement:.2f} (tuning {pick.agreement:.2f}), "
          f"accuracy {heldout.accuracy:.2f} (dense {dense_accuracy:.2f})")
    print(f"server flags: {pick.mode.server_flags()}")


def _lengths(p: argparse.ArgumentParser, flag: str, text: str, minimum: int) -> list[int]:
    """A flag's comma-separated token counts: distinct integers of at least `minimum`, else the parser's error."""
    try:
        lengths = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        p.error(f"{flag} must be comma-separated integers, got {text!r}")
    if (lengths and min(lengths) < minimum) or len(set(lengths)) < len(lengths):
        p.error(f"{flag} must list distinct integers >= {minimum}")
    return lengths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_pic.check_span_quality", description=DESCRIPTION,
                                epilog=RUN_TIME)
    p.add_argument("--model-path", help="HF folder or .gguf (default: the embedded Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--tokenizer-path", help="tokenizer folder (default: the model's)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy", "gguf"),
                   help="as the server's --load-format (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when there is one (default: %(default)s)")
    p.add_argument("--dtype", default="auto",
                   help="auto: float32 on CPU, the checkpoint's dtype on CUDA (default: %(default)s)")
    p.add_argument("--chat-template", help="as the server's --chat-template (default: the tokenizer's)")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: the engine's sizing)")
    p.add_argument("--samples", type=int, default=8, help="items per task in each split (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws the items and seeds the engine (default: %(default)s)")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated subset of {', '.join(TASKS)} (default: all of them)")
    p.add_argument("--head-tokens", default="0,16,32,64,128",
                   help="comma-separated head lengths K tried behind the anchor, 0: the anchor alone "
                        "(default: %(default)s)")
    p.add_argument("--seam-tokens", default="",
                   help="comma-separated seam lengths K tried behind the anchor: head and tail of K each, e.g. 16 "
                        "(default: none, to keep the run short)")
    p.add_argument("--lexical-shares", default="0.1",
                   help="comma-separated query shares tried behind the anchor with lexical selection (each request "
                        "recomputes whole the spans sharing the question's rarest words, at least one); empty: none "
                        "(default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="how far below dense attention's accuracy a recommended setting may fall on any task "
                        "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="requests per Engine.generate call (default: %(default)s)")
    add_size_flags(p, TaskSizes)
    args = p.parse_args(argv)
    args.sizes = sizes_from_flags(p, args, TaskSizes)
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown or not args.tasks:
        p.error(f"unknown or no tasks {unknown}; choose from {', '.join(TASKS)}")
    args.head_tokens = _lengths(p, "--head-tokens", args.head_tokens, minimum=0)
    args.seam_tokens = _lengths(p, "--seam-tokens", args.seam_tokens, minimum=1)
    if not args.head_tokens:
        p.error("--head-tokens must list at least one length")
    try:
        args.lexical_shares = [float(f) for f in args.lexical_shares.split(",") if f.strip()]
    except ValueError:
        p.error(f"--lexical-shares must be comma-separated numbers, got {args.lexical_shares!r}")
    if any(not 0 < f <= 1 for f in args.lexical_shares) or len(set(args.lexical_shares)) < len(args.lexical_shares):
        p.error("--lexical-shares must list distinct shares in (0, 1]")
    if args.samples < 1 or args.batch_size < 1 or not 0 <= args.tolerance <= 1:
        p.error("--samples and --batch-size must be positive and --tolerance in [0, 1]")
    return args


def _workloads(args: argparse.Namespace, model_dir: str,
               tokenizer_dir: str) -> tuple[PromptBuilder, dict[str, Workload]]:
    """The prompt builder and each split's items (SPLITS)."""
    print(f"building {args.samples} tuning and {args.samples} held-out prompts per task for {', '.join(args.tasks)} "
          f"with the tokenizer of {tokenizer_dir}", flush=True)
    tasks = {t: TASKS[t] for t in args.tasks}
    try:
        builder = PromptBuilder(model_dir, tokenizer_dir, args.chat_template)
        return builder, {split: Workload.build(tasks, args.samples, args.seed, args.sizes, builder, split)
                         for split in SPLITS}
    except ValueError as e:
        sys.exit(f"error: the prompts could not be built: {e}\n(--chat-template picks a template, a built-in name "
                 "or a file; --tasks leaves out tool_selection for a template that does not render tools)")


def _scores(modes: dict[str, Mode], workload: Workload, builder: PromptBuilder, engine_kwargs: dict[str, Any],
            batch_size: int) -> dict[str, dict[str, TaskModeResult]]:
    runs = run_modes(modes, workload, builder, engine_kwargs, RunConfig(batch_size=batch_size),
                     _Printer(modes, workload))
    return results(runs, workload)


def main(argv: list[str] | None = None) -> Recommendation:
    args = parse_args(argv)
    if args.model_path is None:
        print("no --model-path: using the embedded default model (its first use assembles and converts it, "
              "about a minute)", flush=True)
    model_dir, tokenizer_dir = model_dirs(args.model_path, args.tokenizer_path, args.load_format)
    builder, workloads = _workloads(args, model_dir, tokenizer_dir)
    engine_kwargs: dict[str, Any] = {
        "model_path": model_dir, "tokenizer_path": tokenizer_dir, "load_format": args.load_format,
        "dtype": args.dtype, "device": args.device, "chat_template": args.chat_template, "random_seed": args.seed,
    }
    if args.max_total_tokens is not None:
        engine_kwargs["max_total_tokens"] = args.max_total_tokens
    modes = settings(args.head_tokens, args.seam_tokens, args.lexical_shares)
    print("tuning: every setting on the tuning items", flush=True)
    scores = _scores(modes, workloads["tuning"], builder, engine_kwargs, args.batch_size)
    per_setting = setting_scores(scores, modes)
    pick = recommend(per_setting, args.tolerance)
    print(f"held out: {pick.name} (chosen on the tuning items), dense and isolated spans on the held-out items",
          flush=True)
    checked = {name: modes[name] for name in (REFERENCE, BASELINE, pick.name)}
    held_scores = _scores(checked, workloads["heldout"], builder, engine_kwargs, args.batch_size)
    held = {s.name: s for s in setting_scores(held_scores, checked)}
    print_table("tuning items (the setting is chosen on these):", scores, per_setting)
    print_choice(pick, args.tolerance)
    print_table("held-out items (never chosen on):", held_scores, list(held.values()))
    print_heldout(pick, held[pick.name], mean_over_tasks(held_scores, REFERENCE, "accuracy"))
    return Recommendation(pick, held[pick.name])

