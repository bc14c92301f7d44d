"""SGLang's parallel encoding on a real model: fork one statement per fork, join(mode="concate_and_append").

The program is SGLang's test_parallel_encoding, with statements and questions drawn from a seed: k statements
"A is the father of B." in random order, a question about one B, gold answer its A. Each sample runs twice
against one server, through sglang's own RuntimeEndpoint:
  join  the client posts /concate_and_append_request, and the server serves each statement as a span anchored on
        the shared prefix (managers/parallel_encoding.py), read from the KV its fork's commit computed;
  text  SGLang's fallback (global_config.enable_parallel_encoding off): the joined text as one plain prompt,
        dense attention.
Reported per mode: accuracy (the gold name in the answer), agreement of the two modes' answers, span tokens
reused per request, and the span head the server ran with (`span_head_tokens`, read from /get_server_info: the
flag's, else span_policy.DEFAULT_HEAD_TOKENS); statements no longer than the head are recomputed whole.

Usage: python benchmark/bench_parallel_encoding.py --samples 40 [--model-path M] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

FATHERS = ["Ethan", "Noah", "Oliver", "Lucas", "Mason", "Logan", "Elijah", "James", "Aiden", "Henry", "Samuel",
           "Owen", "Caleb", "Isaac", "Felix", "Hugo", "Arthur", "Leo", "Miles", "Victor"]
CHILDREN = ["Liam", "Julian", "Carlos", "Mateo", "Ezra", "Jasper", "Milo", "Theo", "Axel", "Silas", "Rowan",
            "Declan", "Emmett", "Jonah", "Micah", "Tobias", "Wesley", "Xavier", "Zane", "Adrian"]
START_TIMEOUT_S = 900.0  # the first start may assemble the embedded model


def make_samples(n: int, seed: int, statements: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        fathers, children = rng.sample(FATHERS, statements), rng.sample(CHILDREN, statements)
        asked = rng.randrange(statements)
        out.append({"contexts": [f"{f} is the father of {c}." for f, c in zip(fathers, children)],
                    "question": f"Who is the father of {children[asked]}?", "gold": fathers[asked]})
    return out


def program():
    import sglang as sgl

    @sgl.function
    def parallel_encoding(s, question, contexts):
        s += "USER: I will ask a question based on some statements.\n"
        s += "ASSISTANT: Sure. I will give the answer.\n"
        s += "USER: Please memorize these statements.\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Now, please answer the following question. Do not list options."
        s += "\nQuestion: " + question + "\n"
        s += "ASSISTANT:" + sgl.gen("answer", max_tokens=16, temperature=0)

    return parallel_encoding


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "sglang_pic.launch_server", "--port", str(port), "--log-level", "warning"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.span_head_tokens is not None:
        cmd += ["--span-head-tokens", str(args.span_head_tokens)]
    log = tempfile.NamedTemporaryFile(prefix="bench_parallel_encoding_", suffix=".log", delete=False)
    print(f"starting the server (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}; see {log.name}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the server did not get healthy in {START_TIMEOUT_S:.0f} s; see {log.name}")


def run_mode(url: str, samples: list[dict], join: bool) -> list[dict]:
    import sglang as sgl
    from sglang.global_config import global_config

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    global_config.enable_parallel_encoding = join
    fn = program()
    out = []
    for sample in samples:
        state = fn.run(question=sample["question"], contexts=sample["contexts"])
        meta = state.get_meta_info("answer")
        out.append({"answer": state["answer"], "correct": sample["gold"] in state["answer"],
                    "cached_span_tokens": meta.get("cached_span_tokens", 0), "prompt_tokens": meta["prompt_tokens"]})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="default: the embedded model")
    p.add_argument("--dtype")
    p.add_argument("--span-head-tokens", type=int, help="the server's --span-head-tokens (default: its default)")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--statements", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "parallel_encoding.json")
    args = p.parse_args(argv)
    samples = make_samples(args.samples, args.seed, args.statements)
    proc, url = launch(args)
    try:
        head = requests.get(url + "/get_server_info", timeout=60).json()["span_head_tokens"]
        runs = {mode: run_mode(url, samples, mode == "join") for mode in ("text", "join")}
    finally:
        proc.terminate()
        proc.wait(60)
    report = {
        "samples": args.samples, "statements": args.statements, "model_path": args.model_path or "embedded",
        "span_head_tokens": head,
        "modes": {mode: {"accuracy": sum(r["correct"] for r in rows) / len(rows),
                         "mean_cached_span_tokens": sum(r["cached_span_tokens"] for r in rows) / len(rows),
                         "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / len(rows)}
                  for mode, rows in runs.items()},
        "answer_agreement": sum(a["answer"] == b["answer"] for a, b in zip(runs["text"], runs["join"])) / len(samples),
        "examples": [{"question": s["question"], "gold": s["gold"], **{m: runs[m][i]["answer"] for m in runs}}
                     for i, s in enumerate(samples[:5])],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for mode, r in report["modes"].items():
        print(f"{mode:<5} accuracy {r['accuracy']:.2f}  span tokens reused {r['mean_cached_span_tokens']:.0f} "
              f"of {r['mean_prompt_tokens']:.0f}")
    print(f"answers equal in both modes: {report['answer_agreement']:.2f}; span head {head} tokens; "
          f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
