"""Host time to fill a step's grammar masks: one matcher at a time vs xgrammar's batch filler (several threads).

Every matcher sits inside a JSON string of a json_schema (the common state: free text, most tokens allowed), over
the embedded Qwen2.5-Coder tokenizer (151,936 ids). A step's masks are filled after the next forward is launched
and before its sampling, so this time runs beside the forward but still gates the sampling.

    python benchmark/bench_grammar_mask.py [--batch-sizes 32,256] [--tokenizer DIR] [--out FILE]

--tokenizer: a folder with the tokenizer (default: the embedded model's; build/llama3-8b-dummy from make_config.py
carries the same one).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}, "required": ["city"]}


def main() -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from sglang_pic.model_loader import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="32,256")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tokenizer", help="tokenizer folder (default: the embedded model's)")
    p.add_argument("--out", type=Path, default=Path("benchmark/results/grammar_mask_cpu.json"))
    args = p.parse_args()
    vocab = 151936
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_path())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    filler = xgr.BatchGrammarMatcher()
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(batch)]
        for m in matchers:
            m.accept_string('{"city": "Pa')
        bitmask = xgr.allocate_token_bitmask(batch, vocab)
        start = time.perf_counter()
        for _ in range(args.repeats):
            for j, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, j)
        one_by_one = (time.perf_counter() - start) / args.repeats
        start = time.perf_counter()
        for _ in range(args.repeats):
            filler.batch_fill_next_token_bitmask(matchers, bitmask)
        batched = (time.perf_counter() - start) / args.repeats
        rows.append({"batch": batch, "one_by_one_ms": one_by_one * 1e3, "batched_ms": batched * 1e3})
        print(f"batch {batch:4d}: one by one {one_by_one * 1e3:6.2f} ms, batched {batched * 1e3:6.2f} ms per step")
    args.out.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
