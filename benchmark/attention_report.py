"""What bench_attention_kernels.py prints: a line per measured case as it runs, and the summary tables of a report
(the JSON it writes).
"""

from __future__ import annotations

import math

KINDS = ("decode", "extend", "store")


def log_row(row: dict) -> None:
    shapes = {"decode": lambda: f"b{row['batch']} x {row['context']}", "store": lambda: f"{row['tokens']} tokens"}
    shape = shapes.get(row["kind"], lambda: row["case"])()
    cfg = row.get("config", "")
    print(
        f"  {row['kind']:7s} {shape:32s} free {row['position_free_ms']:8.4f} ms  "
        f"pre {row['prerotated_ms']:8.4f} ms  overhead {row['overhead_pct']:+6.1f}%  noise {row['noise_pct']:4.1f}%  "
        f"{_throttle_note(row)}{cfg}",
        flush=True,
    )


def _throttle_note(row: dict) -> str:
    """'capped, SM >= N MHz' for a case measured while the GPU throttled under load; '' otherwise."""
    t = row.get("telemetry", {})
    return f"capped, SM >= {t['min_sm_mhz']} MHz " if t.get("throttled") else ""


def print_summary(report: dict) -> None:
    roof = report["ceilings"]
    roofs = f"copy {roof['copy_gbps']:.0f} GB/s, bf16 matmul {roof['bf16_matmul_tflops']:.0f} TFLOP/s"
    print(f"\n{report['meta']['device']}: {roofs}; noise: the largest spread of one variant's rounds")
    print(f"{'decode':>14s} {'free ms':>9s} {'pre ms':>9s} {'free GB/s':>10s} {'pre GB/s':>9s} {'overhead':>9s} noise")
    for r in report["decode"]:
        shape = f"b{r['batch']} x {r['context']}"
        times = f"{r['position_free_ms']:9.4f} {r['prerotated_ms']:9.4f}"
        rates = f"{r['position_free_gbps']:10.0f} {r['prerotated_gbps']:9.0f}"
        print(f"{shape:>14s} {times} {rates} {r['overhead_pct']:+8.1f}% {r['noise_pct']:4.1f}% {_throttle_note(r)}")
    head = f"{'free ms':>9s} {'pre ms':>9s} {'free TF/s':>10s} {'pre TF/s':>9s} {'overhead':>9s} noise"
    print(f"{'extend (store + attention)':>34s} {head} {'stage ms':>9s} {'in-kernel rotation':>19s} {'attn only':>9s}")
    for r in report["extend"]:
        times = f"{r['position_free_ms']:9.3f} {r['prerotated_ms']:9.3f}"
        rates = f"{r['position_free_tflops']:10.0f} {r['prerotated_tflops']:9.0f}"
        in_kernel = f"{r['in_kernel_ms']:9.3f} {r['in_kernel_overhead_pct']:+8.1f}%"
        stage = f"{r['stage_ms']:9.4f}" if r["staged"] else f"{'-':>9s}"
        attention = f"{r['attention_overhead_pct']:+8.1f}%" if "attention_overhead_pct" in r else f"{'-':>9s}"
        overhead = f"{r['overhead_pct']:+8.1f}% {r['noise_pct']:4.1f}%"
        print(f"{r['case']:>34s} {times} {rates} {overhead} {stage} {in_kernel} {attention} {_throttle_note(r)}")
    for r in report["store"]:
        print(
            f"store {r['tokens']} tokens: free {r['position_free_ms']:.4f} ms, free + staged keys "
            f"{r['position_free_staged_ms']:.4f} ms, pre {r['prerotated_ms']:.4f} ms"
        )
    for kind in ("decode", "extend"):
        if report[kind]:
            rows = report[kind]
            geo = math.exp(sum(math.log1p(r["overhead_pct"] / 100) for r in rows) / len(rows))
            print(f"{kind} overhead, geometric mean: {100 * (geo - 1):+.1f}%")
    rows = [r for kind in KINDS for r in report[kind] if r.get("telemetry", {}).get("samples")]
    if rows:
        capped = sum(r["telemetry"]["throttled"] for r in rows)
        print(f"cases measured while the GPU throttled under load (power or thermal): {capped} of {len(rows)}")
    best: dict[str, dict] = {}
    for r in report.get("sweep", []):
        shape = r.get("case") or f"decode b{r['batch']} x {r['context']}"
        for variant in ("position_free", "prerotated"):
            key = f"{shape} {variant}"
            if key not in best:
                best[key] = {"default_ms": r[f"{variant}_ms"], "best_ms": r[f"{variant}_ms"], "config": r["config"]}
            elif r[f"{variant}_ms"] < best[key]["best_ms"]:
                best[key].update(best_ms=r[f"{variant}_ms"], config=r["config"])
    for key, b in best.items():  # the first config swept per shape is the default
        print(f"sweep {key}: default {b['default_ms']:.4f} ms, best {b['best_ms']:.4f} ms with {b['config']}")
