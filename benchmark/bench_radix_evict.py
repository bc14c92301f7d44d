"""Host time of one radix-cache eviction as the tree grows: a server whose cache fills its pool evicts for every
admission that needs room, so this is paid per admitted request (CPU only, no model).

The tree holds N span roots of --span-tokens tokens each (one node per span, the shape a RAG or agent cache takes);
each timed call evicts one span's worth of tokens, and a lookup then touches a random span so the LRU order moves.

With --host-tier the spans wait in a full host tier instead, and each call first drops the LRU host span.

Usage: python benchmark/bench_radix_evict.py [--nodes 1000,5000,20000] [--calls 200] [--host-tier] [--out ...]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from time import perf_counter

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rag_spans import args_json, write_json  # noqa: E402

from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang_pic.mem_cache.host_pool import HostKVPool  # noqa: E402
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang_pic.radix_ext.radix_cache import RadixCache  # noqa: E402
from sglang_pic.radix_ext.radix_tree import RadixKey


def evict_ms(nodes: int, span_tokens: int, calls: int, seed: int) -> float:
    """Mean milliseconds of evict(span_tokens) over `calls` calls on a tree of `nodes` span roots."""
    rng = random.Random(seed)
    allocator = TokenToKVPoolAllocator(nodes * span_tokens, 1, torch.device("cpu"))
    tree = RadixCache(allocator, 1)
    keys = [random_key(rng, span_tokens, f"span:{i}") for i in range(nodes)]
    for key in keys:
        tree.insert(key, allocator.alloc(span_tokens))
    total = 0.0
    for _ in range(calls):
        tree.match_prefix(keys[rng.randrange(nodes)])
        start = perf_counter()
        tree.evict(span_tokens)
        total += perf_counter() - start
    return total / calls * 1000


def host_evict_ms(nodes: int, span_tokens: int, calls: int, seed: int) -> float:
    """The same with a full host tier: the tree's `nodes` spans wait in host memory, and each call moves a fresh
    span there, which first drops the least recently used host span."""
    rng = random.Random(seed)
    allocator = TokenToKVPoolAllocator((nodes + 2) * span_tokens, 1, torch.device("cpu"))
    device_pool = MHATokenToKVPool(allocator.size, 1, torch.float32, 1, 1, 1, "cpu")
    tree = RadixCache(allocator, 1, host_pool=HostKVPool(device_pool, nodes * span_tokens))
    for i in range(nodes):
        tree.insert(random_key(rng, span_tokens, f"span:{i}"), allocator.alloc(span_tokens))
    tree.evict(nodes * span_tokens)
    total = 0.0
    for i in range(calls):
        tree.insert(random_key(rng, span_tokens, f"fresh:{i}"), allocator.alloc(span_tokens))
        start = perf_counter()
        tree.evict(span_tokens)
        total += perf_counter() - start
    return total / calls * 1000


def random_key(rng: random.Random, tokens: int, namespace: str) -> RadixKey:
    return RadixKey(tuple(rng.randrange(32000) for _ in range(tokens)), namespace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1000,5000,20000", help="comma-separated tree sizes (span roots)")
    p.add_argument("--span-tokens", type=int, default=150)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-tier", action="store_true", help="the spans wait in a full host tier (hierarchical cache)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    measure = host_evict_ms if args.host_tier else evict_ms
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        ms = measure(n, args.span_tokens, args.calls, args.seed)
        rows.append({"nodes": n, "evict_ms": ms})
        print(f"{n:>7} span nodes: {ms:8.3f} ms per eviction", flush=True)
    if args.out is not None:
        write_json(args.out, {"args": args_json(args), "rows": rows})


if __name__ == "__main__":
    main()
