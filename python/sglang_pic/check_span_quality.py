"""`python -m sglang_pic.check_span_quality --model-path M`: a quick span-quality run on your own model.

Spans trade answer quality for prefill work, and how much depends on the model. This runs the quick tasks
(sglang_pic/span_quality_tasks.py: factual QA, tool selection, needle) with dense attention and with spans under
each setting: isolated (`--span-anchor none`) and anchored with each K of --head-tokens (`--span-anchor auto
--span-head-tokens K`, K = 0 being the anchor alone). Per task and setting it prints how often the answer agrees
with dense attention's, how often the first token does, and how many more prefill tokens a request computes than
with isolated spans. It then recommends the cheapest setting whose mean agreement with dense is within
--tolerance of the best setting's, with the server flags that select it. The full-size run with KL, accuracy by
needle depth and a RAG task is benchmark/bench_span_quality.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_pic.model_loader.loader import model_dirs
from sglang_pic.span_quality import (
    BASELINE,
    MODES,
    REFERENCE,
    Mode,
    ModeRun,
    Progress,
    PromptBuilder,
    RunConfig,
    TaskModeResult,
    Workload,
    add_size_flags,
    results,
    run_modes,
    sizes_from_flags,
    span_mode,
    span_mode_name,
)
from sglang_pic.span_quality_tasks import TASKS, TaskSizes


@dataclass(frozen=True)
class SettingScore:
    """One span setting's scores, averaged over the tasks (each task weighs the same)."""

    name: str
    mode: Mode
    agreement: float  # answers that agree with dense attention's
    top1: float  # first tokens that agree with dense attention's
    extra_tokens: float  # prefill tokens computed per request beyond isolated spans'


RULE = (
    "the cheapest setting (fewest extra prefill tokens) whose mean agreement with dense is within {tol:g} of the "
    "best setting's"
)


def recommend(scores: Sequence[SettingScore], tolerance: float) -> SettingScore:
    """The cheapest setting whose agreement is within `tolerance` of the best one's; between equally cheap ones the
    more agreeing, then the earlier."""
    best = max(s.agreement for s in scores)
    fits = [s for s in scores if s.agreement >= best - tolerance - 1e-9]  # 1e-9: 0.95 - 0.05 is 0.8999...
    return min(fits, key=lambda s: (s.extra_tokens, -s.agreement))


def settings(head_tokens: Sequence[int]) -> dict[str, Mode]:
    """dense (the reference), isolated spans (the cost baseline), then the anchor with each head length."""
    anchored = {span_mode_name("auto", k): span_mode("auto", k) for k in head_tokens}
    return {REFERENCE: MODES[REFERENCE], BASELINE: MODES[BASELINE], **anchored}


def setting_scores(scores: dict[str, dict[str, TaskModeResult]], modes: dict[str, Mode]) -> list[SettingScore]:
    def mean(name: str, field: str) -> float:
        return float(np.mean([getattr(by_mode[name], field) for by_mode in scores.values()]))

    return [SettingScore(name, mode, mean(name, "agreement_with_dense"), mean(name, "first_token_top1_agreement"),
                         mean(name, "extra_prefill_tokens_per_request"))
            for name, mode in modes.items() if name != REFERENCE]


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


def print_report(scores: dict[str, dict[str, TaskModeResult]], per_setting: list[SettingScore], pick: SettingScore,
                 tolerance: float) -> None:
    head = f"{'task':<15} {'setting':<15} {'accuracy':>8} {'agree':>6} {'top1':>6} {'extra tok/req':>13}"
    print()
    print(head)
    print("-" * len(head))
    for task, by_mode in scores.items():
        for name, r in by_mode.items():
            print(f"{task:<15} {name:<15} {r.accuracy:>8.2f} {r.agreement_with_dense:>6.2f} "
                  f"{r.first_token_top1_agreement:>6.2f} {r.extra_prefill_tokens_per_request:>13.1f}")
    print("-" * len(head))
    for s in per_setting:
        print(f"{'mean':<15} {s.name:<15} {'':>8} {s.agreement:>6.2f} {s.top1:>6.2f} {s.extra_tokens:>13.1f}   "
              f"{s.mode.server_flags()}")
    best = max(per_setting, key=lambda s: s.agreement)
    print()
    print(f"rule: {RULE.format(tol=tolerance)} (here {best.name}, {best.agreement:.2f})")
    print(f"recommended: {pick.name}: agreement with dense {pick.agreement:.2f}, "
          f"{pick.extra_tokens:.1f} extra prefill tokens per request over isolated spans")
    print(f"server flags: {pick.mode.server_flags()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--model-path", help="HF folder or .gguf; default: the embedded Qwen2.5-Coder-0.5B-Instruct")
    p.add_argument("--tokenizer-path")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy", "gguf"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--chat-template", help="as the server's --chat-template (default: the tokenizer's)")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens")
    p.add_argument("--samples", type=int, default=8, help="samples per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--head-tokens", default="0,16,32,64",
                   help="comma-separated head lengths K tried behind the anchor (0: the anchor alone)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="how far below the best mean agreement with dense a recommended setting may be")
    p.add_argument("--batch-size", type=int, default=16, help="requests per Engine.generate call")
    add_size_flags(p, TaskSizes)
    args = p.parse_args(argv)
    args.sizes = sizes_from_flags(p, args, TaskSizes)
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown or not args.tasks:
        p.error(f"unknown or no tasks {unknown}; choose from {', '.join(TASKS)}")
    try:
        args.head_tokens = [int(k) for k in args.head_tokens.split(",") if k.strip()]
    except ValueError:
        p.error(f"--head-tokens must be comma-separated integers, got {args.head_tokens!r}")
    if not args.head_tokens or min(args.head_tokens) < 0 or len(set(args.head_tokens)) < len(args.head_tokens):
        p.error("--head-tokens must list distinct integers >= 0")
    if args.samples < 1 or args.batch_size < 1 or not 0 <= args.tolerance <= 1:
        p.error("--samples and --batch-size must be positive and --tolerance in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> SettingScore:
    args = parse_args(argv)
    if args.model_path is None:
        print("no --model-path: using the embedded default model (its first use assembles and converts it, "
              "about a minute)", flush=True)
    model_dir, tokenizer_dir = model_dirs(args.model_path, args.tokenizer_path, args.load_format)
    print(f"building {args.samples} prompts per task for {', '.join(args.tasks)} with the tokenizer of "
          f"{tokenizer_dir}", flush=True)
    try:
        builder = PromptBuilder(model_dir, tokenizer_dir, args.chat_template)
        workload = Workload.build({t: TASKS[t] for t in args.tasks}, args.samples, args.seed, args.sizes, builder)
    except ValueError as e:
        sys.exit(f"error: the prompts could not be built: {e}\n(--chat-template picks a template, a built-in name "
                 "or a file; --tasks leaves out tool_selection for a template that does not render tools)")
    modes = settings(args.head_tokens)
    engine_kwargs: dict[str, Any] = {
        "model_path": model_dir, "tokenizer_path": tokenizer_dir, "load_format": args.load_format,
        "dtype": args.dtype, "device": args.device, "chat_template": args.chat_template, "random_seed": args.seed,
    }
    if args.max_total_tokens is not None:
        engine_kwargs["max_total_tokens"] = args.max_total_tokens
    runs = run_modes(modes, workload, builder, engine_kwargs, RunConfig(batch_size=args.batch_size),
                     _Printer(modes, workload))
    scores = results(runs, workload)
    per_setting = setting_scores(scores, modes)
    pick = recommend(per_setting, args.tolerance)
    print_report(scores, per_setting, pick, args.tolerance)
    return pick


if __name__ == "__main__":
    main()
