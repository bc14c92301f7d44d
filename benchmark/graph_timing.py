"""Timing of GPU work captured in CUDA graphs, for the kernel benchmarks: replays timed by triton.testing.do_bench
with a cold L2, variants interleaved so that a drift of the GPU's clocks falls on all of them alike, and the device's
copy and matmul ceilings.
"""

from __future__ import annotations

from statistics import median
from typing import Callable

import torch

DEVICE = "cuda"


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after one run outside the capture that compiles and warms it up."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, rep_ms: int) -> float:
    """Median time of one replay, cold L2 (do_bench flushes it)."""
    import triton.testing

    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")


def graph_time_ms(fn: Callable[[], object], rep_ms: int) -> float:
    """Median time of one replay of `fn` captured in a CUDA graph, cold L2."""
    return replay_ms(capture(fn), rep_ms)


def interleaved_ms(fns: dict[str, Callable[[], object]], rep_ms: int, rounds: int) -> dict[str, list[float]]:
    """Each function's replay time in `rounds` rounds, the functions taking turns within a round in an order that
    reverses every round, so a drift of the GPU's clocks over the run falls on all of them alike."""
    graphs = {name: capture(fn) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(graphs)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(replay_ms(graphs[name], rep_ms))
    return times


def spread_pct(times: dict[str, list[float]]) -> float:
    """The largest spread of one function's round times, in percent of its median: differences between
    functions smaller than this are noise."""
    return max(100.0 * (max(t) - min(t)) / median(t) for t in times.values())


def ceilings(rep_ms: int) -> dict:
    """Measured device-to-device copy bandwidth and bf16 matmul rate, the roofs for GB/s and TFLOP/s below."""
    import triton.testing

    src = torch.empty(2**31, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=rep_ms, return_mode="median")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEVICE)
    mm_ms = triton.testing.do_bench(lambda: a @ b, rep=rep_ms, return_mode="median")
    return {"copy_gbps": 2 * src.numel() / copy_ms / 1e6, "bf16_matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}
