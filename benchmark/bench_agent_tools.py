"""Agent tool use through the OpenAI API: tool descriptions as plain prompt text vs as spans, on a drifting trace.

Each mode gets a fresh server (so no mode inherits another's cache) and serves the same sessions (agent_workload.py)
concurrently with the official `openai` client, streaming, each session waiting for its reply before its next turn:
  prefix_cache    extra_body tool_spans=false: tools rendered as text, reused only while everything before matches.
  tool_spans      extra_body tool_spans=true: each description is a span with the server's span settings.
  isolated_spans  spans with no anchor and no head tokens: each description encoded on its own.
Replies are greedy and go back into the history as the model wrote them (the agent acts on the first call), so a
mode's later turns see its own earlier answers; prefix_cache is the exact reference the span modes agree with.

Usage: python benchmark/bench_agent_tools.py --quick --model-path TINY_QWEN2 --chat-template tools.jinja
       python benchmark/bench_agent_tools.py --model-path Qwen/Qwen2.5-7B-Instruct --sessions 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import openai
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from agent_workload import Session, Workload, WorkloadConfig, arguments_valid, build_workload  # noqa: E402
from soak_server import OwnServer  # noqa: E402

MODES = ("prefix_cache", "tool_spans", "isolated_spans")
MODE_BODIES: dict[str, dict[str, Any]] = {
    "prefix_cache": {"tool_spans": False},
    "tool_spans": {"tool_spans": True},
    "isolated_spans": {"tool_spans": {"span_anchor": "none", "span_head_tokens": 0}},
}
REFERENCE_MODE = "prefix_cache"
DEFAULT_OUT = Path(__file__).parent / "results" / "agent_tools.json"
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0

# A Hermes-style tools template (Qwen2.5's layout) for models whose own template ignores tools, such as the tiny
# test models: write it to a file and pass that as --chat-template.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Trace and server sizes: the full run, and --quick (a tiny model on CPU). Flags override.
PRESETS: dict[str, dict[str, Any]] = {
    "full": dict(num_tools=40, description_tokens=(150, 600), sessions=16, min_turns=5, max_turns=15,
                 session_tools=(8, 20), result_tokens=(100, 1000), max_tokens=64, dtype=None,
                 max_total_tokens=None),
    "quick": dict(num_tools=6, description_tokens=(39, 78), sessions=3, min_turns=3, max_turns=3,
                  session_tools=(3, 5), result_tokens=(26, 78), max_tokens=8, dtype="float32",
                  max_total_tokens=32768),
}


@dataclass
class TurnRecord:
    session: int
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    expected_tool: str
    called_tool: str | None  # the first call's name; None when the reply was text
    arguments: str | None
    correct: bool  # the expected tool, with arguments that fit its schema
    text: str


@dataclass
class ModeResult:
    mode: str
    turns: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_p50_by_turn_s: list[float]
    output_tokens_per_s: float
    total_tokens_per_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_tokens_computed: int
    cache_hit_ratio: float
    tool_call_accuracy: float
    agreement_with_reference: float | None  # share of turns whose action equals prefix_cache's
    records: list[TurnRecord]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="HF folder or hub id (default: the server's embedded model)")
    p.add_argument("--tokenizer-path")
    p.add_argument("--load-format")
    p.add_argument("--dtype")
    p.add_argument("--chat-template", help="a tools-aware template file (HERMES_TEMPLATE for tiny models)")
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--sessions", type=int)
    p.add_argument("--min-turns", type=int)
    p.add_argument("--max-turns", type=int)
    p.add_argument("--change-prob", type=float, default=0.3, help="chance per turn that the session's tools change")
    p.add_argument("--stable", action="store_true", help="every session keeps its tools (the regression trace)")
    p.add_argument("--max-tokens", type=int, help="per assistant turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--quick", action="store_true", help="tiny CPU run: few short tools, sessions and results")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path; the PNG goes next to it")
    p.add_argument("--server-arg", action="append", default=[], help="passed to the server (repeatable)")
    args = p.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    if args.min_turns > args.max_turns:
        p.error(f"--min-turns {args.min_turns} exceeds --max-turns {args.max_turns}")
    return args


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_tools=args.num_tools, description_tokens=args.description_tokens, sessions=args.sessions,
        turns=(args.min_turns, args.max_turns), session_tools=args.session_tools, result_tokens=args.result_tokens,
        change_prob=args.change_prob, stable=args.stable, seed=args.seed,
    )


def server_flags(args: argparse.Namespace) -> list[str]:
    """The passthrough flags every mode's server gets (the mode itself travels in each request)."""
    flags = []
    for name in ("tokenizer_path", "load_format", "dtype", "chat_template", "max_total_tokens"):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + list(args.server_arg)


# ---- one session -------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    ttft_s: float
    latency_s: float
    text: str
    calls: list[dict[str, str]]  # id, name, arguments, in the order the model wrote them
    usage: Any


async def stream_turn(client: openai.AsyncOpenAI, request: dict[str, Any]) -> Reply:
    """One streamed chat completion, assembled from its deltas; TTFT is the first chunk with a choice (the server
    sends it with the first generated token)."""
    start = perf_counter()
    ttft, text, calls, usage = None, [], {}, None
    stream = await client.chat.completions.create(**request)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ttft = perf_counter() - start if ttft is None else ttft
            text.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    if ttft is None or usage is None:
        raise RuntimeError(f"a streamed reply came back without {'a choice' if ttft is None else 'usage'}")
    return Reply(ttft, perf_counter() - start, "".join(text), [calls[i] for i in sorted(calls)], usage)


async def run_session(
    client: openai.AsyncOpenAI, workload: Workload, index: int, session: Session, mode: str, max_tokens: int,
    bar: tqdm,
) -> list[TurnRecord]:
    messages: list[dict[str, Any]] = []
    records = []
    for t, turn in enumerate(session.turns):
        messages.append({"role": "user", "content": turn.task})
        request = dict(
            model="default", messages=messages, tools=[workload.catalog[i].openai() for i in turn.tools],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body=MODE_BODIES[mode],
        )
        reply = await stream_turn(client, request)
        expected = workload.catalog[turn.target]
        first = reply.calls[0] if reply.calls else None
        details = reply.usage.prompt_tokens_details
        records.append(TurnRecord(
            session=index, turn=t, ttft_s=reply.ttft_s, latency_s=reply.latency_s,
            prompt_tokens=reply.usage.prompt_tokens, cached_tokens=(details.cached_tokens or 0) if details else 0,
            completion_tokens=reply.usage.completion_tokens, expected_tool=expected.name,
            called_tool=first["name"] if first else None, arguments=first["arguments"] if first else None,
            correct=first is not None and first["name"] == expected.name
            and arguments_valid(expected.parameters, first["arguments"]),
            text=reply.text,
        ))
        call_id = first["id"] if first else f"call_{index}_{t}"
        calls = [{"id": call_id, "type": "function", "function": {"name": first["name"],
                                                                  "arguments": first["arguments"]}}] if first else None
        messages.append({"role": "assistant", "content": reply.text or None, "tool_calls": calls})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": turn.result})
        bar.update(1)
    return records


async def run_sessions(url: str, workload: Workload, mode: str, max_tokens: int) -> tuple[list[TurnRecord], float]:
    """Every session at once; returns their turns and the wall time."""
    total = sum(len(s.turns) for s in workload.sessions)
    # No retries: a retried turn would count its failed attempt in its TTFT.
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S) as client:
        with tqdm(total=total, desc=mode, unit="turn", leave=False) as bar:
            start = perf_counter()
            per_session = await asyncio.gather(*(
                run_session(client, workload, i, s, mode, max_tokens, bar) for i, s in enumerate(workload.sessions)
            ))
            wall = perf_counter() - start
    return [r for records in per_session for r in records], wall


def serve_mode(args: argparse.Namespace, workload: Workload, mode: str) -> tuple[list[TurnRecord], float]:
    """A fresh server for the mode, stopped (its whole process group) whatever happens."""
    fd, name = tempfile.mkstemp(prefix=f"agent_tools_{mode}_", suffix=".log")
    os.close(fd)  # OwnServer opens the log itself
    log = Path(name)
    server = OwnServer(args.model_path, server_flags(args), log, STARTUP_TIMEOUT_S)
    try:
        server.wait_healthy()
        return asyncio.run(run_sessions(server.url, workload, mode, args.max_tokens))
    finally:
        server.stop()


# ---- report ------------------------------------------------------------------------------------------------------
def action(record: TurnRecord) -> tuple[str, str]:
    """What a turn did, compared across modes: its first call (arguments canonicalised when they parse) or text."""
    if record.called_tool is None:
        return "text", record.text
    try:
        return record.called_tool, json.dumps(json.loads(record.arguments or ""), sort_keys=True)
    except json.JSONDecodeError:
        return record.called_tool, record.arguments or ""


def summarize(mode: str, records: list[TurnRecord], wall: float) -> ModeResult:
    ttft = np.array([r.ttft_s for r in records])
    by_turn = [float(np.median([r.ttft_s for r in records if r.turn == t]))
               for t in range(max(r.turn for r in records) + 1)]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    return ModeResult(
        mode=mode, turns=len(records), wall_s=wall, ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)), ttft_p50_by_turn_s=by_turn,
        output_tokens_per_s=completion / wall, total_tokens_per_s=(prompt + completion) / wall,
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
        prefill_tokens_computed=prompt - cached, cache_hit_ratio=cached / prompt,
        tool_call_accuracy=sum(r.correct for r in records) / len(records), agreement_with_reference=None,
        records=sorted(records, key=lambda r: (r.session, r.turn)),
    )


def add_agreement(results: list[ModeResult]) -> None:
    reference = next((m for m in results if m.mode == REFERENCE_MODE), None)
    if reference is None:
        return
    expected = {(r.session, r.turn): action(r) for r in reference.records}
    for m in results:
        m.agreement_with_reference = sum(action(r) == expected[(r.session, r.turn)] for r in m.records) / m.turns


def plot(results: list[ModeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in results:
        ax.plot(range(1, len(m.ttft_p50_by_turn_s) + 1), m.ttft_p50_by_turn_s, marker="o", label=m.mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("time to first token by turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(results: list[ModeResult]) -> None:
    print(f"{'mode':<16}{'ttft p50':>10}{'ttft p99':>10}{'out tok/s':>11}{'tot tok/s':>11}{'prefilled':>11}"
          f"{'hit':>7}{'acc':>7}{'agree':>7}")
    for m in results:
        agree = "-" if m.agreement_with_reference is None else f"{m.agreement_with_reference:.2f}"
        print(f"{m.mode:<16}{m.ttft_p50_s:>10.3f}{m.ttft_p99_s:>10.3f}{m.output_tokens_per_s:>11.1f}"
              f"{m.total_tokens_per_s:>11.1f}{m.prefill_tokens_computed:>11}{m.cache_hit_ratio:>7.2f}"
              f"{m.tool_call_accuracy:>7.2f}{agree:>7}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    workload = build_workload(workload_config(args))
    results = []
    for mode in tqdm(args.modes, desc="modes", unit="mode"):
        records, wall = serve_mode(args, workload, mode)
        results.append(summarize(mode, records, wall))
    add_agreement(results)
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": workload.summary(),
        "modes": {m.mode: asdict(m) for m in results},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    plot(results, png)
    print_table(results)
    print(f"wrote {args.out} and {png}")
    return result


if __name__ == "__main__":
    main()
