"""Host time of turning a batch of RAG prompts into requests (RequestBuilder.build), on CPU.

The offline Engine tokenizes a whole batch before its first step, and the server's tokenizer process tokenizes a
batched /generate request in one go, so this time precedes every token of the batch. Each repeat builds a fresh
RequestBuilder (an empty segment memo: every passage is encoded once, as for a batch of new documents).

Usage: python benchmark/bench_tokenize.py [--tokenizer-path build/llama3-8b-dummy] [--num-samples 600] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).parent))

from bench_rag_spans import args_json, write_json  # noqa: E402
from rag_workload import WorkloadConfig, build_workload  # noqa: E402

from sglang_pic.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang_pic.managers.request_builder import RequestBuilder  # noqa: E402
from sglang_pic.model_config import ModelConfig  # noqa: E402
from sglang_pic.server_args import ServerArgs  # noqa: E402
from sglang_pic.tokenizer import load_tokenizer  # noqa: E402

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "build" / "llama3-8b-dummy"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer-path", type=Path, default=DEFAULT_TOKENIZER,
                   help="a folder with config.json and a tokenizer (benchmark/make_config.py writes the default)")
    p.add_argument("--num-samples", type=int, default=600)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(str(args.tokenizer_path))
    workload = build_workload(
        WorkloadConfig(num_samples=args.num_samples),
        lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
    )
    prompts = [workload.prompt(s) for s in workload.samples]
    server_args = ServerArgs(model_path=str(args.tokenizer_path))
    model_config = ModelConfig.from_server_args(str(args.tokenizer_path), server_args, "cpu")
    obj = GenerateReqInput(text=prompts, sampling_params={"max_new_tokens": 32})
    times = []
    for _ in range(args.repeats + 1):  # the first run warms the tokenizer's thread pool and is dropped
        builder = RequestBuilder(server_args, tokenizer, model_config)
        start = perf_counter()
        reqs = builder.build(obj)
        times.append(perf_counter() - start)
    ms = statistics.median(times[1:]) * 1e3
    tokens = sum(r.prompt_len for r in reqs)
    print(f"{len(prompts)} prompts, {tokens} tokens: build_requests {ms:.1f} ms (median of {args.repeats})")
    result = {"args": args_json(args), "prompts": len(prompts), "prompt_tokens": tokens, "build_requests_ms": ms}
    if args.out is not None:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
