"""TTFT of a cached span placed at a new offset behind a new prefix, against computing the same prompt cold.

For each span length: prompt A = system prompt A + span + question warms the span; prompt B = a different,
longer system prompt + the same span + the question puts it at another offset. TTFT of B (max_new_tokens 1) is
measured on an empty cache (cold) and right after A (cached); their ratio is what position-free reuse buys.

Usage: python benchmark/bench_span_ttft.py --quick
       python benchmark/bench_span_ttft.py --model-path CFG_DIR --load-format dummy --span-lengths 512,4096,32768
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from bench_rag_spans import (  # noqa: E402
    DEFAULT_OUT,
    add_engine_args,
    args_json,
    device_name,
    engine_kwargs,
    resolve_paths,
    warm_up,
    write_json,
)
from rag_workload import SYSTEM_PROMPT, WorkloadConfig, build_workload, rag_prompt  # noqa: E402

from sglang_pic import Engine  # noqa: E402
from sglang_pic.tokenizer import load_tokenizer  # noqa: E402

OTHER_SYSTEM_PROMPT = (
    "You are a careful research assistant. Read the document below, then answer the question that follows it "
    "in one short sentence."
)
QUESTION = "Who is mentioned first in the document?"
PASSAGE_TOKENS = (100, 200)

PRESETS = {
    "full": dict(span_lengths="512,1024,2048,4096,8192,16384,32768", repeats=3, max_total_tokens=None, dtype="auto"),
    "quick": dict(span_lengths="32,64,96", repeats=1, max_total_tokens=4096, dtype="float32"),
}


@dataclass
class LengthResult:
    span_tokens: int
    prompt_tokens: int
    cold_ttft_s: float
    cached_ttft_s: float
    speedup: float  # cold / cached
    cached_span_tokens: int  # what the cached run reused (equals span_tokens when the span hit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--span-lengths", help="comma-separated span lengths in tokens")
    p.add_argument("--repeats", type=int, help="runs per length; the median is reported")
    p.add_argument("--quick", action="store_true", help="tiny CPU run: short spans, one repeat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for span_ttft.json and span_ttft.png")
    args = p.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.span_lengths = [int(x) for x in args.span_lengths.split(",") if x]
    return args


def make_span(tokenizer, num_tokens: int, seed: int) -> str:
    """About `num_tokens` tokens of workload passages, cut at a token boundary."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    corpus_size = num_tokens // PASSAGE_TOKENS[0] + 2
    cfg = WorkloadConfig(num_samples=0, num_passages=1, corpus_size=corpus_size, passage_tokens=PASSAGE_TOKENS,
                         seed=seed)
    text = "".join(p.text for p in build_workload(cfg, count).corpus)
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens])


def ttft(engine: Engine, prompt: str) -> dict:
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
    return out["meta_info"]


def measure(engine: Engine, doc: str, repeats: int) -> LengthResult:
    prompt_a = rag_prompt(SYSTEM_PROMPT, [doc], QUESTION)
    prompt_b = rag_prompt(OTHER_SYSTEM_PROMPT, [doc], QUESTION)
    span_tokens = len(engine.tokenizer.encode(doc, add_special_tokens=False))
    cold, cached, reused, prompt_tokens = [], [], [], 0
    for _ in range(repeats):
        engine.flush_cache()
        cold.append(ttft(engine, prompt_b)["ttft"])
        engine.flush_cache()
        ttft(engine, prompt_a)
        meta = ttft(engine, prompt_b)
        cached.append(meta["ttft"])
        reused.append(meta["cached_span_tokens"])
        prompt_tokens = meta["prompt_tokens"]
    return LengthResult(span_tokens, prompt_tokens, median(cold), median(cached), median(cold) / median(cached),
                        min(reused))


def plot(results: list[LengthResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r.span_tokens for r in results]
    ax.plot(x, [r.cold_ttft_s for r in results], "o-", label="cold (span computed)")
    ax.plot(x, [r.cached_ttft_s for r in results], "s-", label="cached span at a new offset")
    for r in results:
        ax.annotate(f"{r.speedup:.1f}x", (r.span_tokens, r.cached_ttft_s), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("span tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT of a reused span behind a new prefix")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir, tokenizer_dir = resolve_paths(args)
    tokenizer = load_tokenizer(tokenizer_dir)
    engine = Engine(**engine_kwargs(args, model_dir, tokenizer_dir))
    try:
        warm_up(engine, rag_prompt(SYSTEM_PROMPT, [make_span(tokenizer, 16, args.seed + 1)], QUESTION))
        results = [measure(engine, make_span(tokenizer, n, args.seed), args.repeats)
                   for n in tqdm(args.span_lengths, desc="span lengths", unit="length")]
    finally:
        engine.shutdown()
    result = {
        "config": args_json(args),
        "device": device_name(),
        "torch": torch.__version__,
        "model_dir": model_dir,
        "lengths": [asdict(r) for r in results],
    }
    write_json(args.out / "span_ttft.json", result)
    plot(results, args.out / "span_ttft.png")
    print(f"{'span tokens':>12}{'cold s':>10}{'cached s':>10}{'speedup':>9}")
    for r in results:
        print(f"{r.span_tokens:>12}{r.cold_ttft_s:>10.4f}{r.cached_ttft_s:>10.4f}{r.speedup:>9.2f}")
    print(f"wrote {args.out / 'span_ttft.json'} and {args.out / 'span_ttft.png'}")
    return result


if __name__ == "__main__":
    main()
