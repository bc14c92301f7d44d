"""Running span-quality modes: each mode runs every task through one Engine (its cache shared across the samples,
as in real use), greedy, in batches, and is shut down before the next starts. The reference mode runs first; the
others ask for their logprobs of its top first tokens, which scoring.py compares."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sglang_pic.engine import Engine
from sglang_pic.span_quality.items import Item
from sglang_pic.span_quality.judging import judge
from sglang_pic.span_quality.modes import MARKINGS, REFERENCE, Mode
from sglang_pic.span_quality.prompts import Prompt, PromptBuilder, Workload


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
    span_tokens: int  # the prompt's
    recomputed_span_tokens: int  # of those, the ones the request computed itself with full attention


@dataclass
class ModeRun:
    """What one mode's Engine gave: records and wall seconds per task, and the Engine's own counters."""

    records: dict[str, list[Record]]
    walls: dict[str, float]
    engine_start_s: float
    computed_prefill_tokens: int
    reused_prefill_tokens: int


@dataclass(frozen=True)
class RunConfig:
    batch_size: int = 16  # requests per Engine.generate call
    kl_top_k: int = 20  # dense first tokens the KL is taken over


class Progress:
    """What run_modes reports as it goes (starting an Engine loads the model); this base reports nothing."""

    def engine_starting(self, mode: str, index: int, total: int) -> None: ...

    def task_starting(self, mode: str, task: str) -> None: ...

    def requests_done(self, n: int) -> None: ...

    def mode_done(self, mode: str, run: ModeRun) -> None: ...


def _first_logprobs(meta: dict[str, Any], asked: bool) -> dict[int, float]:
    row = meta["output_token_ids_logprobs" if asked else "output_top_logprobs"][0]
    return {tok: lp for lp, tok, _ in row}


def _recomputed_span_tokens(mode: Mode, prompt: Prompt, meta: dict[str, Any]) -> int:
    """Dense sends no spans: every document token attends fully, as if each span were recomputed whole."""
    return prompt.span_tokens if mode.marking == "dense" else meta["recomputed_span_tokens"]


def run_task(
    engine: Engine, mode: Mode, builder: PromptBuilder, items: list[Item], prompts: list[Prompt],
    max_new_tokens: int, reference: list[Record] | None, config: RunConfig, progress: Progress,
) -> tuple[list[Record], float]:
    """Every item through `engine` in batches; (records, wall seconds)."""
    records: list[Record] = []
    wall = 0.0
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    for lo in range(0, len(items), config.batch_size):
        batch = prompts[lo : lo + config.batch_size]
        logprobs: dict[str, Any] = {"return_logprob": True}
        if reference is None:
            logprobs["top_logprobs_num"] = config.kl_top_k
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
                prompt_tokens=meta["prompt_tokens"],
                computed_tokens=meta["prompt_tokens"] - meta["cached_tokens"] + meta["probe_tokens"],
                span_tokens=prompt.span_tokens, recomputed_span_tokens=_recomputed_span_tokens(mode, prompt, meta),
            ))
        progress.requests_done(len(batch))
    return records, wall


def run_modes(
    modes: dict[str, Mode], workload: Workload, builder: PromptBuilder, engine_kwargs: dict[str, Any],
    config: RunConfig = RunConfig(), progress: Progress | None = None,
) -> dict[str, ModeRun]:
    """Each mode over every task through its own Engine (`engine_kwargs` plus the mode's), one Engine at a time.
    The reference mode, when present, must come first: the others ask for their logprobs of its top tokens."""
    progress = progress or Progress()
    if REFERENCE in modes and next(iter(modes)) != REFERENCE:
        raise ValueError(f"the reference mode {REFERENCE!r} must run first")
    for name, mode in modes.items():
        if mode.marking not in MARKINGS:
            raise ValueError(f"mode {name!r} has marking {mode.marking!r}, not one of {MARKINGS}")
    runs: dict[str, ModeRun] = {}
    for index, (name, mode) in enumerate(modes.items()):
        progress.engine_starting(name, index, len(modes))
        start = time.perf_counter()
        records: dict[str, list[Record]] = {}
        walls: dict[str, float] = {}
        with Engine(**{**engine_kwargs, **mode.engine_kwargs}) as engine:
            built = time.perf_counter()
            for t, task in workload.tasks.items():
                progress.task_starting(name, t)
                reference = runs[REFERENCE].records[t] if REFERENCE in runs else None
                records[t], walls[t] = run_task(engine, mode, builder, workload.items[t], workload.prompts[t],
                                                task.max_new_tokens, reference, config, progress)
            stats = engine.get_stats()
        runs[name] = ModeRun(records, walls, built - start, stats["computed_prefill_tokens"],
                             stats["reused_prefill_tokens"])
        progress.mode_done(name, runs[name])
    return runs
