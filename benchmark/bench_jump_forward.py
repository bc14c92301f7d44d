"""Jump-forward decoding: JSON-schema replies with and without `--enable-jump-forward`, on the same engine build.

Each request asks for an object with several fixed keys; the grammar forces the keys and punctuation, which
jump-forward appends as tokens and prefills in one step. Reports wall time, forward steps, output tokens and that
every reply parses and fits the schema.

    python benchmark/bench_jump_forward.py [--model-path DIR] [--num-requests 16] [--out FILE]

Default model: the embedded Qwen2.5-Coder-0.5B-Instruct (real weights, so replies are real JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "city_name": {"type": "string", "maxLength": 24},
        "country_name": {"type": "string", "maxLength": 24},
        "population_in_millions": {"type": "integer"},
        "is_capital_city": {"type": "boolean"},
        "main_spoken_language": {"type": "string", "maxLength": 24},
    },
    "required": ["city_name", "country_name", "population_in_millions", "is_capital_city", "main_spoken_language"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Seoul", "Quito", "Rome", "Hanoi", "Accra", "Bern", "Doha",
          "Lagos", "Perth", "Porto", "Kyoto"]


def run(model_path: str | None, jump: bool, prompts: list[str], params: dict) -> dict:
    from sglang_pic import Engine

    with Engine(model_path=model_path, enable_jump_forward=jump, max_total_tokens=16384) as engine:
        engine.generate(prompts[0], params)  # warm-up: grammar compile, first-call costs
        stats = engine.scheduler.stats
        steps, decode_steps = stats.num_steps, stats.num_decode_steps
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        replies = [json.loads(o["text"]) for o in outs]
        assert all(set(r) == set(SCHEMA["properties"]) for r in replies)
        return {
            "jump_forward": jump,
            "wall_s": wall,
            "steps": stats.num_steps - steps,
            "decode_steps": stats.num_decode_steps - decode_steps,
            "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
            "example": outs[0]["text"],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="model folder (default: the embedded Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("benchmark/results/jump_forward_cpu.json"))
    args = p.parse_args()
    prompts = [
        f"<|im_start|>user\nDescribe the city of {CITIES[i % len(CITIES)]} as JSON.<|im_end|>\n<|im_start|>assistant\n"
        for i in range(args.num_requests)
    ]
    params = {"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(SCHEMA)}
    rows = [run(args.model_path, jump, prompts, params) for jump in (False, True)]
    for r in rows:
        print(
            f"jump-forward {'on ' if r['jump_forward'] else 'off'}: {r['wall_s']:6.2f} s, {r['steps']:4d} steps "
            f"({r['decode_steps']} decode), {r['output_tokens']} output tokens"
        )
    print(f"speedup {rows[0]['wall_s'] / rows[1]['wall_s']:.2f}x, steps {rows[0]['steps']} -> {rows[1]['steps']}")
    print("example:", rows[1]["example"])
    result = {"cpus": os.cpu_count(), "num_requests": args.num_requests, "schema": SCHEMA, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
