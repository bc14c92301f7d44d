"""Host (Python) time per scheduler step at large batch sizes, with the model's forward timed apart.

On a GPU the forward of a decode step at batch 256-600 takes a few tens of ms; everything else a step does
(building the batch, sampling, committing tokens, stop checks, streaming the output) is host time the GPU waits
for. This script measures that host time on CPU in the RAG shape of issue 6: ~1.6K-token prompts of 10 cached
spans behind a shared prefix, ~25 own tokens to prefill, 32 output tokens (greedy unless --temperature), on a
tiny Llama so the forward is cheap (and timed separately, or replaced by random logits with --skip-forward).

Two phases per batch size B:
  decode  B requests running, nothing waiting: pure decode steps.
  mixed   the ISPS steady state: B/new_tokens requests arrive every step and prefill next to ~B running decodes,
          while as many finish.
Per step it reports CPU time of this thread (torch runs single-threaded, so other load on the box barely moves it):
  sched   Scheduler.step minus the forward and garbage collection
  output  a streamed chunk (managers/output_format.py: a report, then its formatting) for every request that
          moved, as Engine.generate(stream=True) yields
  gc      Python's cyclic garbage collector, wherever it struck during the step
  host    sched + output + gc, the mean per step

On a GPU (--engine-args with "device": "cuda") the forward's CPU time is what launching a step's kernels costs the
host, which bounds eager steps (mixed steps, prefills) when it exceeds their device time; --profile shows where it
goes.

Usage: python benchmark/bench_step_overhead.py [--batch-sizes 128,512] [--steps 40] [--skip-forward]
       python benchmark/bench_step_overhead.py --batch-sizes 512 --phases mixed --profile mixed:512
       python benchmark/bench_step_overhead.py --model-path build/llama3-8b-dummy --load-format dummy \
           --batch-sizes 128 --phases mixed --profile mixed:128 \
           --engine-args '{"device": "cuda", "dtype": "bfloat16", "quantization": "fp8"}'
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from time import thread_time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))

from tiny_models import build_tiny_model  # noqa: E402

from sglang_pic import Engine  # noqa: E402
from sglang_pic.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang_pic.managers.output_format import Reporter, RequestOutputs  # noqa: E402

SSEP, PDEP = -1, -2  # the engine's default marker ids in input_ids
FIRST_ID = 4  # ids below are the tiny tokenizer's special tokens
CONTEXT = 4096
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "build" / "tiny-llama-4k"


@dataclass
class PhaseResult:
    phase: str
    batch_size: int
    steps: int
    running_mean: float  # requests in each step's batch
    prefill_tokens_mean: float  # prompt tokens computed per step
    host_ms: float  # mean per step of sched + output + gc
    host_p50_ms: float
    sched_ms: float
    output_ms: float
    gc_ms: float
    forward_ms: float


class Workload:
    """Prompts as input_ids: a shared prefix, `passages` spans drawn from a corpus, a question of their own."""

    def __init__(self, vocab: int, corpus_size: int, passages: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.passages = passages
        self.prefix = self.tokens(20)
        self.corpus = [self.tokens(self.rng.randint(100, 200)) for _ in range(corpus_size)]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]

    def prompt(self, docs: list[list[int]] | None = None, question_tokens: int | None = None) -> list[int]:
        ids = list(self.prefix)
        for doc in docs if docs is not None else self.rng.sample(self.corpus, self.passages):
            ids += [SSEP, *doc, PDEP]
        return ids + self.tokens(question_tokens or self.rng.randint(20, 30))


class StepClock:
    """CPU time of one step split into forward, garbage collection and the rest (the runner's forward is wrapped)."""

    def __init__(self, engine: Engine, skip_forward: bool) -> None:
        self.forward_s = self.gc_s = 0.0
        self.batch_size = self.prefill_tokens = 0
        self._gc_start = 0.0
        self.reporter = Reporter(engine.server_args.stream_interval)  # the streamed requests' output path
        self.outputs = RequestOutputs(engine.formatter)
        runner = engine.runner
        inner = runner.forward_local
        vocab = runner.model_config.vocab_size

        def timed_forward(batch):
            start = thread_time()
            logits = torch.randn(batch.logits_indices.numel(), vocab) if skip_forward else inner(batch)
            self.forward_s += thread_time() - start
            self.batch_size = batch.batch_size
            self.prefill_tokens = sum(n for n in batch.extend_seq_lens_cpu if n > 1)
            return logits

        runner.forward_local = timed_forward
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = thread_time()
        else:
            self.gc_s += thread_time() - self._gc_start

    def step(self, engine: Engine) -> tuple[float, float, float, float]:
        """(sched, output, gc, forward) seconds of one step."""
        self.forward_s = self.gc_s = 0.0
        start = thread_time()
        updated = engine._step()
        mid, gc_mid = thread_time(), self.gc_s
        for delta in self.reporter.deltas(updated):
            self.outputs.apply(delta)
        end = thread_time()
        sched = mid - start - self.forward_s - gc_mid
        return sched, end - mid - (self.gc_s - gc_mid), self.gc_s, self.forward_s

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def submit(engine: Engine, clock: StepClock, prompts: list[list[int]], max_new_tokens: int,
           args: argparse.Namespace) -> None:
    params = {"temperature": args.temperature, **args.sampling_params, "max_new_tokens": max_new_tokens,
              "ignore_eos": True}
    msgs = engine.request_builder.build(GenerateReqInput(input_ids=prompts, sampling_params=params, stream=True))
    for msg in msgs:
        clock.reporter.add(msg)
    engine._submit(msgs)


def warm_cache(engine: Engine, workload: Workload, batch: int) -> None:
    """Prefill the shared prefix and every passage, through one-passage requests with questions of their own."""
    for start in range(0, len(workload.corpus), batch):
        docs = workload.corpus[start : start + batch]
        engine.generate(input_ids=[workload.prompt([d], 5) for d in docs],
                        sampling_params={"temperature": 0, "max_new_tokens": 1})


def drain(engine: Engine) -> None:
    sched = engine.scheduler
    for req in list(sched.waiting) + list(sched.running):
        sched.abort_request(req.rid)
    while not sched.is_idle():
        engine._step()


def run_phase(engine: Engine, clock: StepClock, workload: Workload, phase: str, batch: int,
              args: argparse.Namespace, profiler: cProfile.Profile | None) -> PhaseResult:
    sched, steps, new_tokens = engine.scheduler, args.steps, args.new_tokens
    arrivals = max(batch // new_tokens, 1)

    def arrive(n: int, max_new_tokens: int) -> None:
        submit(engine, clock, [workload.prompt() for _ in range(n)], max_new_tokens, args)

    if phase == "decode":
        arrive(batch, args.prior_tokens + steps + 2 * new_tokens)
        while sched.waiting or sched.chunked is not None or len(sched.running) < batch:
            engine._step()
        for _ in range(args.prior_tokens):  # outputs this long before the timed steps, streamed as they grow
            clock.step(engine)
    else:
        for _ in range(2 * new_tokens):  # reach the steady state: as many arrive as finish
            arrive(arrivals, new_tokens)
            engine._step()
    samples, sizes, prefill = [], [], []
    for _ in range(steps):
        if phase == "mixed":
            arrive(arrivals, new_tokens)
        if profiler is not None:
            profiler.enable()
        samples.append(clock.step(engine))
        if profiler is not None:
            profiler.disable()
        sizes.append(clock.batch_size)
        prefill.append(clock.prefill_tokens)
    drain(engine)
    sched_ms, output_ms, gc_ms, forward_ms = (statistics.mean(x) * 1e3 for x in zip(*samples))
    host = [(s + o + g) * 1e3 for s, o, g, _ in samples]
    return PhaseResult(phase, batch, steps, statistics.mean(sizes), statistics.mean(prefill), statistics.mean(host),
                       statistics.median(host), sched_ms, output_ms, gc_ms, forward_ms)


def ensure_model(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    return build_tiny_model(path.parent, "llama", name=path.name, max_position_embeddings=CONTEXT)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="128,512")
    p.add_argument("--phases", default="decode,mixed")
    p.add_argument("--steps", type=int, default=40, help="timed steps per phase")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prior-tokens", type=int, default=0,
                   help="decode phase: output tokens each request has before the timed steps (long streamed outputs)")
    p.add_argument("--temperature", type=float, default=0.0, help="above 0: the sampler's full path")
    p.add_argument("--sampling-params", type=json.loads, default={},
                   help='more sampling params for every request, as JSON: \'{"repetition_penalty": 1.1}\'')
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--corpus-size", type=int, default=200)
    p.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="a tiny Llama, built here on first use")
    p.add_argument("--load-format", default="auto", help="dummy: random weights from the model's config.json")
    p.add_argument("--engine-args", type=json.loads, default={},
                   help='more Engine arguments, as JSON: on a GPU, \'{"device": "cuda", "dtype": "bfloat16"}\' makes '
                        "`forward` the host time of launching the model's steps")
    p.add_argument("--skip-forward", action="store_true",
                   help="random logits instead of the model's forward (faster; the host work is the same)")
    p.add_argument("--profile", help="PHASE:BATCH to run under cProfile (prints the top functions)")
    p.add_argument("--profile-top", type=int, default=40)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> list[PhaseResult]:
    model = ensure_model(args.model_path)
    results = []
    for batch in (int(x) for x in args.batch_sizes.split(",")):
        engine = Engine(**{
            "model_path": str(model), "dtype": "float32", "context_length": CONTEXT, "schedule_policy": "isps",
            "max_running_requests": batch + batch // args.new_tokens + 8, "max_total_tokens": 262144,
            "random_seed": args.seed, "load_format": args.load_format, **args.engine_args,
        })
        workload = Workload(engine.model_config.vocab_size, args.corpus_size, args.passages, args.seed)
        warm_cache(engine, workload, batch)
        clock = StepClock(engine, args.skip_forward)
        for phase in args.phases.split(","):
            profiler = cProfile.Profile() if args.profile == f"{phase}:{batch}" else None
            r = run_phase(engine, clock, workload, phase, batch, args, profiler)
            results.append(r)
            print(f"{phase:6s} B={batch:4d} batch={r.running_mean:6.1f} prefill={r.prefill_tokens_mean:6.1f} | host "
                  f"{r.host_ms:6.2f} ms/step (p50 {r.host_p50_ms:6.2f}): sched {r.sched_ms:6.2f}  output "
                  f"{r.output_ms:5.2f}  gc {r.gc_ms:5.2f} | forward {r.forward_ms:7.2f}", flush=True)
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile_top)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_top)
        clock.close()
        engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> list[PhaseResult]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every op on this thread, so its CPU time is the whole cost
    try:
        results = measure(args)
    finally:
        torch.set_num_threads(threads)
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
