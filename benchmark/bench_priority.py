"""Priority scheduling under load: how long urgent requests wait behind a full batch and a long queue, with
`--enable-priority-scheduling` off and on, on the same engine build.

A backlog of long low-priority requests (more than `--max-running-requests`) is queued at once; then, every
`--urgent-every` steps, one short urgent request arrives (priority 100). Reports the urgent requests' TTFT and
latency (p50 / p99), the backlog's throughput and the preemptions, for both settings.

    python benchmark/bench_priority.py [--model-path DIR --load-format dummy --dtype bfloat16] [--out FILE]

Default model: the embedded Qwen2.5-Coder-0.5B-Instruct on this machine's device.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

URGENT_PRIORITY = 100
WORDS = ("river", "stone", "market", "lantern", "harbor", "orchard", "signal", "window", "garden", "engine")


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace, priority: bool) -> dict:
    from sglang_pic import Engine
    from sglang_pic.managers.io_struct import GenerateReqInput

    rng = random.Random(0)
    engine_args = dict(
        model_path=args.model_path, load_format=args.load_format, dtype=args.dtype,
        max_running_requests=args.max_running_requests, enable_priority_scheduling=priority,
    )
    with Engine(**{k: v for k, v in engine_args.items() if v is not None}) as engine:
        sched = engine.scheduler

        def build(text: str, new_tokens: int, prio: int) -> object:
            params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
            return engine.make_reqs(GenerateReqInput(text=text, sampling_params=params, priority=prio))[0]

        engine.generate(prompt(rng, 32), {"max_new_tokens": 4})  # warm-up
        backlog = [build(prompt(rng, args.prompt_words), args.backlog_tokens, 0) for _ in range(args.backlog)]
        start = time.perf_counter()
        for req in backlog:
            sched.add_request(req)
        urgent: list = []
        sent_at: dict[int, float] = {}  # urgent request -> when it was sent
        done_at: dict[int, float] = {}  # urgent request -> when the step that finished it returned
        steps = 0
        while not all(r.finished() for r in backlog + urgent):
            if len(urgent) < args.urgent and steps >= args.urgent_start and steps % args.urgent_every == 0:
                req = build(prompt(rng, args.prompt_words), args.urgent_tokens, URGENT_PRIORITY)
                sent_at[id(req)] = time.time()
                sched.add_request(req)
                urgent.append(req)
            sched.step()
            steps += 1
            now = time.time()
            for req in urgent:
                if req.finished() and id(req) not in done_at:
                    done_at[id(req)] = now
        wall = time.perf_counter() - start
        assert len(urgent) == args.urgent, "the backlog finished before every urgent request was sent"
        ttft = [r.first_token_time - sent_at[id(r)] for r in urgent]
        latency = [done_at[id(r)] - sent_at[id(r)] for r in urgent]
        return {
            "priority_scheduling": priority,
            "wall_s": wall,
            "steps": steps,
            "urgent_ttft_p50_s": statistics.median(ttft),
            "urgent_ttft_p99_s": percentile(ttft, 0.99),
            "urgent_latency_p50_s": statistics.median(latency),
            "urgent_latency_p99_s": percentile(latency, 0.99),
            "backlog_tokens_per_s": sum(len(r.output_ids) for r in backlog) / wall,
            "preemptions": sched.stats.num_preemptions,
            "retractions": sched.stats.num_retractions,
            "outputs_complete": all(len(r.output_ids) == r.sampling_params.max_new_tokens for r in backlog + urgent),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="model folder (default: the embedded Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--load-format")
    p.add_argument("--dtype")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--backlog", type=int, default=48, help="low-priority requests queued at once")
    p.add_argument("--backlog-tokens", type=int, default=64, help="new tokens per backlog request")
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--urgent", type=int, default=8, help="urgent requests, one per --urgent-every steps")
    p.add_argument("--urgent-tokens", type=int, default=8)
    p.add_argument("--urgent-start", type=int, default=8, help="step of the first urgent request")
    p.add_argument("--urgent-every", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path("benchmark/results/priority_cpu.json"))
    args = p.parse_args()
    rows = [run(args, priority) for priority in (False, True)]
    for r in rows:
        print(
            f"priority scheduling {'on ' if r['priority_scheduling'] else 'off'}: urgent TTFT p50 "
            f"{r['urgent_ttft_p50_s'] * 1e3:8.1f} ms p99 {r['urgent_ttft_p99_s'] * 1e3:8.1f} ms, latency p50 "
            f"{r['urgent_latency_p50_s'] * 1e3:8.1f} ms; backlog {r['backlog_tokens_per_s']:8.1f} tok/s, "
            f"{r['preemptions']} preemptions, {r['steps']} steps, {r['wall_s']:.2f} s"
        )
    print(f"urgent TTFT p50 {rows[0]['urgent_ttft_p50_s'] / rows[1]['urgent_ttft_p50_s']:.1f}x lower with priority")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
