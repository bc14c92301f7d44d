"""Host (CPU) time of a cached-span request as a function of span length, with the model's forward timed apart.

The cached path of bench_span_ttft.py (a warmed span behind a new prefix, one output token) on a tiny Llama with a
real tokenizer: on a GPU the forward is the device's share and everything measured here is added to the TTFT.
Per span length, the median over --repeats runs of:
  tokenize   RequestBuilder.build: split at the markers, tokenize each segment, build the wire message
  schedule   Scheduler steps until the first token (match, batch building, sampling, caching), minus the forward
  host       tokenize + schedule
  forward    wall time of the model's forward (torch_native attention on CPU; not host overhead)
Host parts are CPU time of this thread, so other load on the box barely moves them.

Usage: python benchmark/bench_span_host.py [--span-lengths 512,2048,8192,16384,32768] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter, thread_time
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rag_spans import DEFAULT_OUT, args_json, write_json  # noqa: E402
from bench_span_ttft import OTHER_SYSTEM_PROMPT, QUESTION, make_span  # noqa: E402
from make_config import write_config  # noqa: E402
from rag_workload import SYSTEM_PROMPT, rag_prompt  # noqa: E402

from sglang_pic import Engine  # noqa: E402
from sglang_pic.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang_pic.tokenizer import load_tokenizer  # noqa: E402

TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "build" / "tiny-llama-128k"
ONE_TOKEN = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


@dataclass
class LengthResult:
    span_tokens: int
    cached_span_tokens: int  # equals span_tokens: the run took the cached path
    tokenize_ms: float
    schedule_ms: float
    host_ms: float
    forward_ms: float


class ForwardClock:
    """Wraps the runner's forward: wall time, and this thread's CPU time inside it (to subtract from the step's)."""

    def __init__(self, engine: Engine) -> None:
        self.wall_s = self.cpu_s = 0.0
        inner = engine.runner.forward_local

        def timed(batch):
            wall, cpu = perf_counter(), thread_time()
            try:
                return inner(batch)
            finally:
                self.wall_s += perf_counter() - wall
                self.cpu_s += thread_time() - cpu

        engine.runner.forward_local = timed

    def reset(self) -> None:
        self.wall_s = self.cpu_s = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", type=Path, help=f"model folder (default: a tiny Llama written to {DEFAULT_MODEL})")
    p.add_argument("--tokenizer-path", help="tokenizer for the default model (default: the embedded Qwen2.5 one)")
    p.add_argument("--span-lengths", default="512,2048,8192,16384,32768")
    p.add_argument("--repeats", type=int, default=7, help="runs per length; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for span_host.json")
    args = p.parse_args(argv)
    args.span_lengths = [int(x) for x in args.span_lengths.split(",") if x]
    return args


def default_model(tokenizer_path: str | None) -> Path:
    if not (DEFAULT_MODEL / "config.json").is_file():
        if tokenizer_path is None:
            from sglang_pic.model_loader.default_model import default_model_path

            tokenizer_path = default_model_path()
        write_config(DEFAULT_MODEL, tokenizer_path, 131072, shape=TINY_SHAPE, dtype="float32")
    return DEFAULT_MODEL


def measure(engine: Engine, clock: ForwardClock, doc: str, repeats: int) -> LengthResult:
    """Warm the span with prompt A, then time prompt B (same span, new prefix) up to its first token."""
    prompt_a = rag_prompt(SYSTEM_PROMPT, [doc], QUESTION)
    prompt_b = rag_prompt(OTHER_SYSTEM_PROMPT, [doc], QUESTION)
    tokenize, schedule, forward, reused = [], [], [], []
    for _ in range(repeats):
        engine.flush_cache()
        engine.generate(prompt_a, ONE_TOKEN)
        start = thread_time()
        msgs = engine.request_builder.build(GenerateReqInput(text=prompt_b, sampling_params=ONE_TOKEN))
        tokenized = thread_time()
        clock.reset()
        reqs = engine._submit(msgs)
        engine._run_until_done(reqs)
        tokenize.append(tokenized - start)
        schedule.append(thread_time() - tokenized - clock.cpu_s)
        forward.append(clock.wall_s)
        reused.append(reqs[0].cached_span_tokens)
    tokenize_ms, schedule_ms, forward_ms = (statistics.median(xs) * 1e3 for xs in (tokenize, schedule, forward))
    span_tokens = len(engine.tokenizer.encode(doc, add_special_tokens=False))
    return LengthResult(span_tokens, min(reused), tokenize_ms, schedule_ms, tokenize_ms + schedule_ms, forward_ms)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the forward is not what is measured; one thread keeps it off the host's cores
    model = args.model_path or default_model(args.tokenizer_path)
    tokenizer = load_tokenizer(str(model))
    engine = Engine(model_path=str(model), load_format="dummy", dtype="float32", attention_backend="torch_native",
                    max_total_tokens=2 * max(args.span_lengths) + 4096, random_seed=args.seed)
    clock = ForwardClock(engine)
    try:
        engine.generate(rag_prompt(SYSTEM_PROMPT, [make_span(tokenizer, 16, args.seed + 1)], QUESTION), ONE_TOKEN)
        results = [measure(engine, clock, make_span(tokenizer, n, args.seed), args.repeats) for n in args.span_lengths]
    finally:
        engine.shutdown()
    result = {
        "config": args_json(args),
        "torch": torch.__version__,
        "model_dir": str(model),
        "lengths": [asdict(r) for r in results],
    }
    write_json(args.out / "span_host.json", result)
    print(f"{'span tokens':>12}{'tokenize ms':>13}{'schedule ms':>13}{'host ms':>10}{'forward ms':>12}")
    for r in results:
        print(f"{r.span_tokens:>12}{r.tokenize_ms:>13.2f}{r.schedule_ms:>13.2f}{r.host_ms:>10.2f}{r.forward_ms:>12.2f}")
    print(f"wrote {args.out / 'span_host.json'}")
    return result


if __name__ == "__main__":
    main()
