"""Agent tool use through the OpenAI API: tool descriptions as plain prompt text vs as spans, on a drifting trace.

Each mode gets a fresh server (so no mode inherits another's cache) and serves the same sessions (agent_workload.py)
concurrently with the official `openai` client, streaming, each session waiting for its reply before its next turn:
  prefix_cache    extra_body tool_spans=false: tools rendered as text, reused only while everything before matches.
  tool_spans      extra_body tool_spans=true: each description is a span with the server's span settings.
  isolated_spans  spans with no anchor and no head tokens: each description encoded on its own.
  result_spans    tool_spans, and each tool result in the history a span too (marked in the message's content), so
                  a turn whose tools changed reuses its results' KV instead of prefilling its whole history again.
Replies are greedy and go back into the history as the model wrote them (the agent acts on the first call), so a
mode's later turns see its own earlier answers; prefix_cache is the exact reference the span modes agree with.
Tool-call accuracy reads the model's first call: the server's tool_calls, else a reply that is nothing but one JSON
call object, bare or in a ```json fence (how the embedded 0.5B model writes many calls; the server's parser reads
such a reply as a call too, so this counts the calls a server with another parser left as text); server_call_rate
is the share of turns whose call the server itself returned.

The tool-change study: a turn's history (the messages after the tools) is keyed on everything before it, so a turn
whose tool set differs from its session's previous turn (membership or order) prefills its whole history again, in
every mode. Per mode: the share of such turns, the history tokens they prefilled (counted by the server's
/v1/tokenize after the run, capped at what each turn prefilled) and their share of all prefill tokens computed.

Usage: python benchmark/bench_agent_tools.py --quick --model-path TINY_QWEN2 --chat-template tools.jinja
       python benchmark/bench_agent_tools.py --model-path Qwen/Qwen2.5-7B-Instruct --sessions 32
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import openai
from tqdm import tqdm

from sglang_pic.frontend_lang.markers import span

sys.path.insert(0, str(Path(__file__).parent))

from agent_workload import Session, Workload, WorkloadConfig, arguments_valid, build_workload  # noqa: E402
from soak_server import OwnServer  # noqa: E402

MODES = ("prefix_cache", "tool_spans", "isolated_spans", "result_spans")
MODE_BODIES: dict[str, dict[str, Any]] = {
    "prefix_cache": {"tool_spans": False},
    "tool_spans": {"tool_spans": True},
    "isolated_spans": {"tool_spans": {"span_anchor": "none", "span_head_tokens": 0}},
    "result_spans": {"tool_spans": True},
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
    server_call: bool  # the server returned the call as tool_calls (else it was read from the text, or none)
    tools_changed: bool = False  # the tool list differs from the session's previous turn (membership or order)
    history_tokens: int | None = None  # on such turns: the history the previous turn had computed (count_history)


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
    server_call_rate: float  # turns whose call the server's parser returned as tool_calls
    right_tool_rate: float  # the first call names the expected tool
    schema_valid_rate: float | None  # of those right-tool calls, arguments valid against the schema
    agreement_with_reference: float | None  # share of turns whose action equals prefix_cache's
    # Turns after each session's first whose tools changed, the history tokens they prefilled, those tokens' share of
    # prefill_tokens_computed and the turns' cache hit ratio; TTFT p50 of those turns and of the later turns whose
    # tools stayed.
    tool_change_turns: int
    tool_change_share: float
    tool_change_history_tokens: int
    tool_change_history_share: float
    tool_change_hit_ratio: float  # cached over prompt tokens on those turns
    tool_change_ttft_p50_s: float | None
    same_tools_ttft_p50_s: float | None
    records: list[TurnRecord]


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


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
    p.add_argument("--session-tools", type=pair, help="LO,HI: tools per session")
    p.add_argument("--description-tokens", type=pair, help="LO,HI: tokens per tool description")
    p.add_argument("--result-tokens", type=pair, help="LO,HI: tokens per tool result")
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


FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def call_in_text(text: str) -> dict[str, str] | None:
    """The call a text reply makes when it is only one JSON object {"name", "arguments"}, bare or fenced."""
    fenced = FENCED.fullmatch(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("arguments"), dict):
        return {"name": value["name"], "arguments": json.dumps(value["arguments"])}
    return None


async def run_session(
    client: openai.AsyncOpenAI, workload: Workload, index: int, session: Session, mode: str, max_tokens: int,
    bar: tqdm,
) -> tuple[list[TurnRecord], list[dict[str, Any]]]:
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
        call = first or call_in_text(reply.text)
        details = reply.usage.prompt_tokens_details
        records.append(TurnRecord(
            session=index, turn=t, ttft_s=reply.ttft_s, latency_s=reply.latency_s,
            prompt_tokens=reply.usage.prompt_tokens, cached_tokens=(details.cached_tokens or 0) if details else 0,
            completion_tokens=reply.usage.completion_tokens, expected_tool=expected.name,
            called_tool=call["name"] if call else None, arguments=call["arguments"] if call else None,
            correct=call is not None and call["name"] == expected.name
            and arguments_valid(expected.parameters, call["arguments"]),
            text=reply.text, server_call=first is not None,
            tools_changed=t > 0 and turn.tools != session.turns[t - 1].tools,
        ))
        call_id = first["id"] if first else f"call_{index}_{t}"
        calls = [{"id": call_id, "type": "function", "function": {"name": first["name"],
                                                                  "arguments": first["arguments"]}}] if first else None
        messages.append({"role": "assistant", "content": reply.text or None, "tool_calls": calls})
        result = span(turn.result) if mode == "result_spans" else turn.result
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        bar.update(1)
    return records, messages


async def run_sessions(
    url: str, workload: Workload, mode: str, max_tokens: int
) -> tuple[list[tuple[list[TurnRecord], list[dict[str, Any]]]], float]:
    """Every session at once; returns each one's turns and messages, and the wall time."""
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
    return per_session, wall


def prompt_tokens(port: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]], mode: str) -> int:
    """The prompt tokens of a chat request, as the server renders it for the mode (/v1/tokenize)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)  # direct: no proxy settings
    try:
        body = {"messages": messages, "tools": tools, **MODE_BODIES[mode]}
        conn.request("POST", "/v1/tokenize", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        content = response.read()
        if response.status != 200:
            raise RuntimeError(f"/v1/tokenize answered {response.status}: {content[:300]!r}")
        return json.loads(content)["count"]
    finally:
        conn.close()


def count_history(port: int, workload: Workload, mode: str, records: list[TurnRecord],
                  messages: list[dict[str, Any]]) -> None:
    """Each tool-change turn's history_tokens: the tokens between its tools and its user message, less the tool
    result that came back since the previous turn (new on this turn whatever the tools). The session's messages
    run user, assistant, tool per turn, so turn t's request held messages[:3t + 1]."""
    for r in records:
        if r.tools_changed:
            tools = [workload.catalog[i].openai() for i in workload.sessions[r.session].turns[r.turn].tools]
            user = messages[3 * r.turn]
            earlier = prompt_tokens(port, messages[: 3 * r.turn - 1] + [user], tools, mode)
            r.history_tokens = earlier - prompt_tokens(port, [user], tools, mode)


def serve_mode(args: argparse.Namespace, workload: Workload, mode: str) -> tuple[list[TurnRecord], float]:
    """A fresh server for the mode, stopped (its whole process group) whatever happens."""
    fd, name = tempfile.mkstemp(prefix=f"agent_tools_{mode}_", suffix=".log")
    os.close(fd)  # OwnServer opens the log itself
    log = Path(name)
    server = OwnServer(args.model_path, server_flags(args), log, STARTUP_TIMEOUT_S)
    try:
        server.wait_healthy()
        per_session, wall = asyncio.run(run_sessions(server.url, workload, mode, args.max_tokens))
        for records, messages in per_session:  # after the run, so no count delays a turn
            count_history(server.port, workload, mode, records, messages)
        return [r for records, _ in per_session for r in records], wall
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


def median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def summarize(mode: str, records: list[TurnRecord], wall: float) -> ModeResult:
    ttft = np.array([r.ttft_s for r in records])
    by_turn = [float(np.median([r.ttft_s for r in records if r.turn == t]))
               for t in range(max(r.turn for r in records) + 1)]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    right = [r for r in records if r.called_tool == r.expected_tool]
    later = [r for r in records if r.turn > 0]
    changed = [r for r in later if r.tools_changed]
    # The history follows the tools, so none of it can hit once they change: all of it is prefilled (the cap only
    # guards the count against a turn that prefilled less), but for result_spans' results, which hit as spans
    # (tool_change_hit_ratio shows how much).
    history = sum(min(r.history_tokens or 0, r.prompt_tokens - r.cached_tokens) for r in changed)
    return ModeResult(
        mode=mode, turns=len(records), wall_s=wall, ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)), ttft_p50_by_turn_s=by_turn,
        output_tokens_per_s=completion / wall, total_tokens_per_s=(prompt + completion) / wall,
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
        prefill_tokens_computed=prompt - cached, cache_hit_ratio=cached / prompt,
        tool_call_accuracy=sum(r.correct for r in records) / len(records),
        server_call_rate=sum(r.server_call for r in records) / len(records),
        right_tool_rate=len(right) / len(records),
        schema_valid_rate=sum(r.correct for r in right) / len(right) if right else None,
        agreement_with_reference=None,
        tool_change_turns=len(changed), tool_change_share=len(changed) / len(later) if later else 0.0,
        tool_change_history_tokens=history, tool_change_history_share=history / max(prompt - cached, 1),
        tool_change_hit_ratio=sum(r.cached_tokens for r in changed) / max(sum(r.prompt_tokens for r in changed), 1),
        tool_change_ttft_p50_s=median([r.ttft_s for r in changed]),
        same_tools_ttft_p50_s=median([r.ttft_s for r in later if not r.tools_changed]),
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
    def opt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'mode':<16}{'ttft p50':>10}{'ttft p99':>10}{'out tok/s':>11}{'tot tok/s':>11}{'prefilled':>11}"
          f"{'hit':>7}{'acc':>7}{'server':>8}{'right':>7}{'valid':>7}{'agree':>7}{'changed':>9}{'hist pf':>9}"
          f"{'of pf':>7}{'ch hit':>8}")
    for m in results:
        print(f"{m.mode:<16}{m.ttft_p50_s:>10.3f}{m.ttft_p99_s:>10.3f}{m.output_tokens_per_s:>11.1f}"
              f"{m.total_tokens_per_s:>11.1f}{m.prefill_tokens_computed:>11}{m.cache_hit_ratio:>7.2f}"
              f"{m.tool_call_accuracy:>7.2f}{m.server_call_rate:>8.2f}{m.right_tool_rate:>7.2f}"
              f"{opt(m.schema_valid_rate, '.2f'):>7}"
              f"{opt(m.agreement_with_reference, '.2f'):>7}{m.tool_change_share:>9.2f}"
              f"{m.tool_change_history_tokens:>9}{m.tool_change_history_share:>7.2f}{m.tool_change_hit_ratio:>8.2f}")
    print("acc: right tool, valid arguments; server: calls the server returned as tool_calls; right: right tool; "
          "valid: of those, arguments valid\nchanged: share of later turns whose tools changed; hist pf: history "
          "tokens those turns prefilled; of pf: their share of all prefill; ch hit: those turns' cache hit ratio")


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
