"""Span quality: how far answers move when each document is prefilled as a span instead of with dense attention.

Shared by `python -m sglang_pic.check_span_quality` (a quick run on the user's model) and the full benchmark
(benchmark/bench_span_quality.py). Every item (span_quality_tasks.py, drawn from the tuning or the held-out seeds)
is rendered once through the server's own chat rendering (earlier turns included; tools as spans, as with
`tool_spans: true`) and tokenized by the engine's segmenter. A mode says how the prompt is sent and which Engine
settings serve it:
  dense          the prompt's token ids with the markers dropped (the same ids the spans have), full attention;
  naive          the marked prompt: each document a span prefilled on its own (span_anchor none);
  anchor         spans prefilled behind the model's anchor (span_anchor auto, span_policy.py);
  headK          each request recomputes every span's first K tokens with full attention (span_head_tokens);
  tailK          likewise its last K tokens (span_tail_tokens);
  seamsK         both, K each: the span's two seams;
  ...+queryP     each request's probe pass also recomputes P percent of its span tokens, those its question
                 attends to most (span_query_share);
  ...+devP       likewise, those whose KV at the second layer deviates most from the shared copy
                 (span_select deviation);
  ...+apeTxSy    APE's reweighting of the attention to span keys: temperature x and scale y in percent
                 (span_attention_temperature, span_attention_scale);
  anchor+...     the anchor with a head, tail or seams;
  ...+kvfp8e4m3  the KV cache in fp8 (kv_cache_dtype fp8_e4m3; kvfp8e5m2: fp8_e5m2), for dense and the default spans.

Each mode runs every task through one Engine (its cache shared across the samples, as in real use), greedy, in
batches, and is shut down before the next starts. Per task and mode: accuracy against the gold answers; agreement
with the dense answers (same `judge` key); the first token's top-1 agreement with dense and KL(dense || mode) of
its distribution; computed prefill tokens per request and the extra over naive spans; the share of span tokens the
requests recomputed (meta_info's recomputed_span_tokens over the prompts' span tokens; dense attends every
document token fully, so its share is 1). The KL is over dense's top-K first tokens plus one bucket for the rest
of the vocabulary (each mode returns its logprobs of those ids via token_ids_logprob): a lower bound on the full KL
that is exact when the top K hold all of dense's mass.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from sglang_pic.engine import Engine
from sglang_pic.entrypoints.chat_template import load_chat_template, render_chat
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest
from sglang_pic.entrypoints.tool_calls import tool_call_parser
from sglang_pic.frontend_lang.markers import strip_markers
from sglang_pic.managers.request_builder import RequestBuilder
from sglang_pic.model_config import ModelConfig
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_quality_tasks import Item, Task, TaskSizes, item_seed, judge
from sglang_pic.tokenizer import load_tokenizer


# ---- modes --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    marking: str  # "dense": the prompt's ids without markers; "spans": the marked prompt
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def server_flags(self) -> str:
        """The launch_server flags that serve prompts as this mode does."""
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in self.engine_kwargs.items()]
        return " ".join((["--disable-pic"] if self.marking == "dense" else []) + flags)


MARKINGS = ("dense", "spans")
REFERENCE = "dense"  # the answers and first-token distributions the other modes are compared with
BASELINE = "naive"  # extra prefill tokens are counted over this mode's


def span_mode(anchor: str, head_tokens: int, tail_tokens: int = 0, query_share: float = 0.0,
              temperature: float = 1.0, scale: float = 1.0, select: str = "query") -> Mode:
    """Spans under these Engine settings (a tail or query share of 0, a temperature or scale of 1, the query
    selector are the server's defaults: not passed)."""
    kwargs: dict[str, Any] = {"span_anchor": anchor, "span_head_tokens": head_tokens}
    if tail_tokens:
        kwargs["span_tail_tokens"] = tail_tokens
    if query_share:
        kwargs["span_query_share"] = query_share
    if select != "query":
        kwargs["span_select"] = select
    if (temperature, scale) != (1.0, 1.0):
        kwargs["span_attention_temperature"], kwargs["span_attention_scale"] = temperature, scale
    return Mode("spans", kwargs)


def span_mode_name(anchor: str, head_tokens: int, tail_tokens: int = 0, query_share: float = 0.0,
                   temperature: float = 1.0, scale: float = 1.0, select: str = "query") -> str:
    """naive, anchor, headK, tailK, seamsK (a head and a tail of K each) or headK+tailJ, then queryP or devP (P
    percent of the span tokens chosen by the query probe or by KV deviation), then apeTxSy (APE's temperature x and
    scale y, in percent), all after `anchor+` when the anchor is on."""
    if head_tokens and head_tokens == tail_tokens:
        parts = [f"seams{head_tokens}"]
    else:
        parts = [f"{what}{k}" for what, k in (("head", head_tokens), ("tail", tail_tokens)) if k]
    if query_share:
        parts.append(f"{'query' if select == 'query' else 'dev'}{round(100 * query_share)}")
    if (temperature, scale) != (1.0, 1.0):
        parts.append(f"apeT{round(100 * temperature)}S{round(100 * scale)}")
    if anchor == "auto":
        parts.insert(0, "anchor")
    return "+".join(parts) or BASELINE


_SPAN_SETTINGS = (
    ("none", 0, 0), ("auto", 0, 0), ("none", 8, 0), ("none", 32, 0),
    *(("auto", k, 0) for k in (4, 8, 16, 32, 64, 128, 256)), *(("auto", k, k) for k in (8, 16, 32)),
    *(("auto", 8, 0, share) for share in (0.1, 0.2, 0.3, 0.5)), *(("auto", 8, 8, share) for share in (0.1, 0.2, 0.3)),
    *(("auto", 128, 0, share) for share in (0.1, 0.2, 0.3)), *(("auto", 128, k) for k in (16, 32)),
    ("auto", 64, 32), ("auto", 128, 32, 0.1),
    *(("auto", k, 0, 0.0, t, s) for k in (0, 16) for t, s in ((0.7, 1.1), (0.8, 1.0), (0.9, 0.9), (1.0, 1.2))),
    *(("auto", k, 0, share, 1.0, 1.0, "deviation") for k, shares in ((8, (0.1, 0.2, 0.3, 0.5)), (128, (0.1, 0.2)))
      for share in shares),
)
_SPAN_MODES = {span_mode_name(*setting): span_mode(*setting) for setting in _SPAN_SETTINGS}
MODES: dict[str, Mode] = {
    REFERENCE: Mode("dense"),
    **_SPAN_MODES,
    **{f"{name}+kv{kv.replace('_', '')}": Mode(mode.marking, {**mode.engine_kwargs, "kv_cache_dtype": kv})
       for name, mode in ((REFERENCE, Mode("dense")), ("anchor+head128", _SPAN_MODES["anchor+head128"]))
       for kv in ("fp8_e4m3", "fp8_e5m2")},
}


# ---- inputs -----------------------------------------------------------------------------------------------------
def add_size_flags(parser: argparse.ArgumentParser, sizes: type[TaskSizes]) -> None:
    """A flag per field of `sizes` (a TaskSizes class): --qa-docs N, --rag-passage-tokens MIN,MAX, ..."""
    for f in fields(sizes):
        kind = (lambda s: tuple(int(x) for x in s.split(","))) if isinstance(f.default, tuple) else int
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                            help="task size" + (" (min,max)" if isinstance(f.default, tuple) else ""))


def sizes_from_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, sizes: type[TaskSizes]) -> TaskSizes:
    """The `sizes` the flags of add_size_flags give; a bad combination is the parser's error."""
    try:
        return sizes(**{f.name: getattr(args, f.name) for f in fields(sizes)})
    except ValueError as e:
        parser.error(str(e))


@dataclass(frozen=True)
class Prompt:
    marked: str  # the rendered chat prompt, documents (and tools) marked as spans
    ids: list[int]  # the engine's token ids for it: the dense prompt
    plain_ids_match: bool  # whether tokenizing strip_markers(marked) whole gives `ids` too
    span_tokens: int  # tokens of its span segments: documents and tools


class PromptBuilder:
    """Renders items as the server's chat route does and tokenizes them as the engine does, without a model."""

    def __init__(self, model_dir: str, tokenizer_dir: str, chat_template: str | None) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_dir, tokenizer_path=tokenizer_dir,
                                           chat_template=chat_template)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        config = ModelConfig.from_server_args(model_dir, self.args, device="cpu")
        self.request_builder = RequestBuilder(self.args, self.tokenizer, config)
        self.chat_template = load_chat_template(chat_template, self.tokenizer)
        self.tool_parser = tool_call_parser(self.args.tool_call_parser, config.architecture)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, item: Item) -> Prompt:
        turns = [{"role": t.role, "content": t.content} for t in item.earlier]
        body = ChatCompletionRequest(
            messages=[{"role": "system", "content": item.system}, *turns, {"role": "user", "content": item.user}],
            tools=list(item.tools) or None,
            tool_spans=bool(item.tools),
        )
        marked = render_chat(body, self.tokenizer, self.chat_template, self.args)
        segments = self.request_builder.tokenize(marked)
        ids = [t for seg in segments for t in seg.token_ids]
        plain = self.tokenizer(strip_markers(marked), add_special_tokens=True)["input_ids"]
        spans = sum(len(seg.token_ids) for seg in segments if seg.kind == "span")
        return Prompt(marked, ids, list(plain) == ids, spans)

    def tool_calls(self, item: Item, reply: str) -> list:
        if not item.tools or self.tool_parser is None:
            return []
        return self.tool_parser.parse(reply, {t["function"]["name"] for t in item.tools})[1]


@dataclass(frozen=True)
class Workload:
    """Each task's items of one split (span_quality_tasks.SPLITS) and their prompts."""

    tasks: dict[str, Task]
    split: str
    items: dict[str, list[Item]]
    prompts: dict[str, list[Prompt]]

    @classmethod
    def build(cls, tasks: dict[str, Task], samples: int, seed: int, sizes: TaskSizes,
              builder: PromptBuilder, split: str) -> Workload:
        items = {t: task.make(samples, item_seed(seed, t, split), sizes, builder.count) for t, task in tasks.items()}
        return cls(tasks, split, items, {t: [builder.build(it) for it in items[t]] for t in tasks})

    def requests(self) -> int:
        return sum(len(v) for v in self.items.values())


# ---- running ------------------------------------------------------------------------------------------------------
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


# ---- scoring ------------------------------------------------------------------------------------------------------
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
    span_tokens_per_request: float
    recomputed_span_share: float  # recomputed span tokens over span tokens, all requests together
    wall_s: float
    accuracy_by_depth: dict[str, float] | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)


def first_token_kl(ref: dict[int, float], other: dict[int, float]) -> float:
    """KL(ref || other) over ref's top-K ids plus one bucket for the rest of the vocabulary."""
    p = np.exp(np.array([ref[t] for t in sorted(ref)]))
    q = np.exp(np.array([other[t] for t in sorted(ref)]))
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-12)
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-30)) - np.log(np.maximum(q, 1e-30)))))
    return max(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0), 0.0)


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else float("nan")


def _share(part: int, whole: int) -> float:
    return part / whole if whole else float("nan")


def summarize(
    records: list[Record], items: list[Item], wall: float, reference: list[Record] | None,
    baseline: list[Record] | None, examples: int,
) -> TaskModeResult:
    computed = _mean([r.computed_tokens for r in records])
    result = TaskModeResult(
        samples=len(records),
        accuracy=_mean([r.correct for r in records]),
        agreement_with_dense=None,
        first_token_top1_agreement=None,
        first_token_kl=None,
        prompt_tokens_per_request=_mean([r.prompt_tokens for r in records]),
        computed_prefill_tokens_per_request=computed,
        extra_prefill_tokens_per_request=(
            computed - _mean([r.computed_tokens for r in baseline]) if baseline is not None else None
        ),
        span_tokens_per_request=_mean([r.span_tokens for r in records]),
        recomputed_span_share=_share(sum(r.recomputed_span_tokens for r in records),
                                     sum(r.span_tokens for r in records)),
        wall_s=wall,
        examples=[{"reply": r.reply, "gold": asdict(i.gold), "correct": r.correct}
                  for r, i in zip(records[:examples], items)],
    )
    if reference is not None:
        result.agreement_with_dense = _mean([r.key == d.key for r, d in zip(records, reference)])
        result.first_token_top1_agreement = _mean([r.first_token == d.first_token for r, d in zip(records, reference)])
        result.first_token_kl = _mean([first_token_kl(d.first_logprobs, r.first_logprobs)
                                       for r, d in zip(records, reference)])
    buckets = sorted({i.bucket for i in items if i.bucket is not None}, key=lambda b: int(b.split("-")[0]))
    if buckets:
        result.accuracy_by_depth = {
            b: _mean([r.correct for r, i in zip(records, items) if i.bucket == b]) for b in buckets
        }
    return result


def results(runs: dict[str, ModeRun], workload: Workload, examples: int = 0) -> dict[str, dict[str, TaskModeResult]]:
    """task -> mode -> its scores, against the reference and baseline modes where they ran."""
    def records(mode: str, task: str) -> list[Record] | None:
        return runs[mode].records[task] if mode in runs else None

    return {
        t: {m: summarize(run.records[t], workload.items[t], run.walls[t], records(REFERENCE, t),
                         records(BASELINE, t), examples)
            for m, run in runs.items()}
        for t in workload.tasks
    }


def mean_over_tasks(scores: dict[str, dict[str, TaskModeResult]], mode: str, name: str) -> float | None:
    """A mode's field `name` averaged over the tasks, each weighing the same (None where a task has none)."""
    values = [getattr(by_mode[mode], name) for by_mode in scores.values()]
    return None if any(v is None for v in values) else _mean(values)


def reference_topk_mass(runs: dict[str, ModeRun], task: str) -> float | None:
    """How much of the reference's first-token distribution its top K hold (where the KL is exact)."""
    if REFERENCE not in runs:
        return None
    return float(np.mean([np.exp(list(r.first_logprobs.values())).sum() for r in runs[REFERENCE].records[task]]))
