"""Where a serving run's time goes: reads the server's --step-trace (managers/step_trace.py) and, optionally, the
result of `python -m sglang.bench_serving --output-file`, and attributes the run's wall time.

The run is laid out on the device's timeline: each step's forward (device_s) and the device idle before it
(device_gap_s). Wall time = device busy + device idle. The device idle before a step is charged, walking back from
its forward call, to what the host was doing then: planning and building this step (`plan_build`), the loop with
work pending (`loop`: outputs, new requests, calls that ran no forward), waiting with nothing to run (`no_work`),
committing the step before (`commit`), and whatever remains (`other`: device work outside the forwards, such as
uploads or a deviation pass, or timer rounding). Off CUDA the forward runs on the host and the split is exact.

The bound is a roofline per step from the ceilings given: compute 2 * params * new tokens at the matmul peak plus
attention (4 * layers * query heads * head_dim per query-key pair) at attention's peak, memory the weights (bytes
per parameter * params) plus the KV read (each request's keys) and written; a step takes at least the larger of the
two, and the bound is their sum over the steps, one after another. Wall time beyond it = device time beyond each
step's bound + device idle.

Writes JSON (--out, default: beside the trace) and a PNG with the same stem: the timeline (device and host lanes),
the attribution, and histograms of prefill chunk sizes and decode batch sizes.

Usage: python benchmark/bench_serving_breakdown.py TRACE [--bench-result RESULT.jsonl] [--window-s S]
           [--tflops 790 --hbm-tbps 4.25 --params-b 8.03] [--model-config DIR] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("prefill", "mixed", "decode", "span_job", "probe", "spec_round")
GAP_CAUSES = ("plan_build", "loop", "no_work", "commit", "other")
COLORS = {
    "prefill": "tab:blue", "mixed": "tab:purple", "decode": "tab:green", "span_job": "tab:orange",
    "probe": "tab:brown", "spec_round": "tab:olive", "plan_build": "tab:red", "loop": "tab:pink",
    "no_work": "lightgray", "commit": "tab:cyan", "other": "black", "launch": "salmon", "settle": "tab:cyan",
}


@dataclass
class Ceilings:
    """What the device can do and what the model costs: the bound's inputs."""

    tflops: float  # dense bf16 matmul peak, TFLOP/s
    hbm_tbps: float  # memory bandwidth, TB/s
    params_b: float  # parameters, billions
    weight_bytes: float  # bytes per parameter
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_bytes: float  # bytes per KV element
    attention_tflops: float  # attention's matmul peak: bf16 even when the weights' GEMMs run in fp8

    @property
    def attn_flops_per_pair(self) -> float:
        return 4.0 * self.layers * self.q_heads * self.head_dim  # QK^T and PV, a multiply-add each

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def step_bound(self, step: dict) -> tuple[float, float]:
        """(compute seconds, memory seconds) of one step at the ceilings."""
        params = self.params_b * 1e9
        compute = (2.0 * params * step["new_tokens"] / self.tflops
                   + self.attn_flops_per_pair * step["attn_pairs"] / self.attention_tflops) / 1e12
        moved = self.weight_bytes * params + self.kv_bytes_per_token * (step["context_tokens"] + step["new_tokens"])
        return compute, moved / (self.hbm_tbps * 1e12)


def model_shape(folder: str) -> dict:
    """layers, heads, head_dim and the parameter count of a HF config.json (a folder or the file)."""
    path = Path(folder)
    cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q_heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", q_heads)
    head_dim = cfg.get("head_dim") or hidden // q_heads
    per_layer = hidden * head_dim * (2 * q_heads + 2 * kv_heads) + 3 * hidden * cfg["intermediate_size"] + 2 * hidden
    embeddings = cfg["vocab_size"] * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    params = layers * per_layer + embeddings + hidden
    return dict(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, params_b=params / 1e9)


# ---- reading -------------------------------------------------------------------------------------------------
def read_runs(path: str) -> list[tuple[dict, list[dict]]]:
    """(header, steps) of each run appended to the trace, in order."""
    runs: list[tuple[dict, list[dict]]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "trace" in row:
            runs.append((row, []))
        elif runs:
            runs[-1][1].append(row)
        else:
            raise ValueError(f"{path}: a step line before the trace's header")
    if not runs:
        raise ValueError(f"{path}: no trace header")
    return runs


def read_bench_result(path: str) -> dict:
    """bench_serving appends one JSON object per run to its --output-file: the last one."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])


# ---- the timeline ----------------------------------------------------------------------------------------------
@dataclass
class Placed:
    """A step on the device's timeline and its host call, in seconds from the run's first call."""

    step: dict
    dev_start: float
    dev_end: float
    call: float  # the call's start
    called: float  # the forward called
    queued: float  # the forward queued
    ended: float  # the call's end


def place(steps: list[dict]) -> list[Placed]:
    """Chain the device times (each step starts device_gap_s after the previous one ended); a step without a known
    gap starts when its forward was called. A spec round (its forwards untimed) is device time over its whole call."""
    t0 = steps[0]["t"]
    out: list[Placed] = []
    for s in steps:
        call = s["t"] - t0
        queued = call + s["host_s"]
        if s["device_s"] is None:
            out.append(Placed(s, call, queued, call, call, queued, queued + s["settle_s"]))
            continue
        called = queued - s["launch_s"]
        gap = s["device_gap_s"]
        start = out[-1].dev_end + gap if out and gap is not None else called
        out.append(Placed(s, start, start + s["device_s"], call, called, queued, queued + s["settle_s"]))
    return out


def in_window(placed: list[Placed], window_s: float | None) -> list[Placed]:
    """The steps of the last `window_s` seconds of the device timeline (all: None)."""
    if window_s is None:
        return placed
    end = placed[-1].dev_end
    return [p for p in placed if p.dev_start >= end - window_s]


def from_first_start(placed: list[Placed]) -> list[Placed]:
    """The steps from the first one the scheduler started idle. bench_serving's duration runs from its first
    request's send to its last reply, so the trace's last that many seconds reach a little before the benchmark's
    first step; its warm-up requests finish a second before that (it sleeps 1 s), so the scheduler starts the
    benchmark's first step idle, and any warm-up step still in the window comes before it."""
    first = next((i for i, p in enumerate(placed) if p.step["idle_s"] > 0), 0)
    return placed[first:]


def gap_causes(prev: Placed, p: Placed) -> dict[str, float]:
    """The device idle before `p`, charged walking back from its forward call: this call's planning and building,
    the loop before it, waiting with nothing to run, the previous call's commit, the rest."""
    s = p.step
    left = max(p.dev_start - prev.dev_end, 0.0)
    out = {}
    for cause, host in (("plan_build", p.called - p.call), ("loop", s["loop_s"]),
                        ("no_work", s["idle_s"]), ("commit", prev.step["settle_s"])):
        out[cause] = min(left, max(host, 0.0))
        left -= out[cause]
    out["other"] = left
    return out


# ---- the breakdown ---------------------------------------------------------------------------------------------
def buckets(values: list[int]) -> list[dict]:
    """Counts of positive values in power-of-two buckets [lo, hi]."""
    counts: dict[int, int] = defaultdict(int)
    for v in values:
        counts[v.bit_length() - 1] += 1
    return [{"lo": 2**e, "hi": 2 ** (e + 1) - 1, "steps": counts[e]} for e in sorted(counts)]


def summary(values: list[int]) -> dict:
    if not values:
        return {"steps": 0}
    ordered = sorted(values)
    return {
        "steps": len(values), "mean": statistics.fmean(values), "p50": ordered[len(ordered) // 2],
        "p90": ordered[int(len(ordered) * 0.9)], "max": ordered[-1], "histogram": buckets(values),
    }


def breakdown(placed: list[Placed], ceilings: Ceilings) -> dict:
    steps = [p.step for p in placed]
    wall = placed[-1].dev_end - placed[0].dev_start
    by_kind: dict[str, dict] = {}
    for kind in KINDS:
        mine = [p for p in placed if p.step["kind"] == kind]
        if not mine:
            continue
        rooflines = [ceilings.step_bound(p.step) for p in mine if kind != "spec_round"]  # a round's are unknown
        bound = sum(max(r) for r in rooflines)
        device = sum(p.dev_end - p.dev_start for p in mine)
        by_kind[kind] = {
            "steps": len(mine), "device_s": device, "bound_s": bound, "beyond_bound_s": device - bound,
            "new_tokens": sum(p.step["new_tokens"] for p in mine),
            "memory_bound_steps": sum(1 for compute, memory in rooflines if memory >= compute),
        }
    idle = dict.fromkeys(GAP_CAUSES, 0.0)
    for prev, p in zip(placed, placed[1:]):
        for cause, seconds in gap_causes(prev, p).items():
            idle[cause] += seconds
    device = sum(k["device_s"] for k in by_kind.values())
    bound = sum(k["bound_s"] for k in by_kind.values())
    decodes = [s for s in steps if s["kind"] == "decode"]
    extends = [s["extend_tokens"] for s in steps if s["extend_tokens"] > 0]
    return {
        "steps": len(steps),
        "wall_s": wall,
        "host_span_s": placed[-1].ended - placed[0].call,
        "device_busy_s": device,
        "device_idle_s": sum(idle.values()),
        "device_by_kind": by_kind,
        "device_idle_by_cause": idle,
        "host_not_hidden_s": sum(v for cause, v in idle.items() if cause != "no_work"),
        "bound_s": bound,
        "bound_share_of_wall": bound / wall if wall > 0 else None,
        "beyond_bound_s": wall - bound,
        "beyond_bound": {
            **{f"device_{kind}": k["beyond_bound_s"] for kind, k in by_kind.items()},
            **{f"idle_{cause}": v for cause, v in idle.items()},
        },
        "host_totals": {name: sum(s[name] for s in steps) for name in ("host_s", "launch_s", "settle_s", "loop_s",
                                                                        "idle_s")},
        "tokens": {
            "extend": sum(extends), "decode_rows": sum(s["decode_reqs"] for s in steps),
            "span_job": sum(s["span_job_tokens"] for s in steps), "probe": sum(s["probe_tokens"] for s in steps),
        },
        "prefill_chunk_tokens": summary(extends),
        "decode_batch_size": summary([s["decode_reqs"] for s in decodes]),
        "decode_cuda_graph_share": sum(s["cuda_graph"] for s in decodes) / len(decodes) if decodes else None,
        "extend_cuda_graph_steps": sum(1 for s in steps if s["cuda_graph"] and s["kind"] != "decode"),
    }


def bench_comparison(result: dict, report: dict) -> dict:
    """bench_serving's own view next to the trace's."""
    keys = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "input_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
            "mean_itl_ms", "max_concurrency", "request_rate")
    mine = {k: result[k] for k in keys if k in result}
    mine["trace_wall_over_duration"] = report["wall_s"] / result["duration"] if result.get("duration") else None
    return mine


# ---- output ----------------------------------------------------------------------------------------------------
def plot(placed: list[Placed], report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig = plt.figure(figsize=(13, 9))
    grid = fig.add_gridspec(3, 2, height_ratios=[1.2, 1, 1])
    timeline, shares = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, :])
    chunks, batches = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    t0 = placed[0].dev_start
    for kind in KINDS:
        bars = [(p.dev_start - t0, p.dev_end - p.dev_start) for p in placed if p.step["kind"] == kind]
        if bars:
            timeline.broken_barh(bars, (2, 0.8), color=COLORS[kind])
    for name, lo, hi in (("plan_build", "call", "called"), ("launch", "called", "queued"),
                         ("settle", "queued", "ended")):
        bars = [(getattr(p, lo) - t0, getattr(p, hi) - getattr(p, lo)) for p in placed]
        timeline.broken_barh(bars, (1, 0.8), color=COLORS[name])
    timeline.set_yticks([1.4, 2.4], ["host", "device"])
    timeline.set_ylim(0.8, 3.6)  # room for the legend above the lanes
    timeline.set_xlabel("seconds")
    timeline.set_title(f"{report['steps']} steps, wall {report['wall_s']:.3f} s, bound {report['bound_s']:.3f} s")
    timeline.legend(handles=[Patch(color=COLORS[k], label=k) for k in (*KINDS[:5], "plan_build", "launch", "settle")],
                    ncol=8, fontsize=7, loc="upper right")
    left = 0.0
    parts = [("bound", report["bound_s"], "darkgreen")]
    parts += [(f"beyond: {k}", max(v, 0.0), COLORS[k.removeprefix("device_").removeprefix("idle_")])
              for k, v in report["beyond_bound"].items() if v > 0]
    for label, seconds, color in parts:
        shares.barh(0, seconds, left=left, color=color, label=f"{label} {seconds:.3f} s")
        left += seconds
    shares.set_yticks([])
    shares.set_xlabel("seconds of wall time")
    shares.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    for ax, key, label in ((chunks, "prefill_chunk_tokens", "prefill chunk (extend tokens per step)"),
                           (batches, "decode_batch_size", "decode batch size")):
        hist = report[key].get("histogram", [])
        ax.bar([f"{h['lo']}-{h['hi']}" for h in hist], [h["steps"] for h in hist], color="tab:gray")
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("steps")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(report: dict) -> None:
    wall = report["wall_s"] or float("nan")
    print(f"steps {report['steps']}  wall {wall:.4f} s  bound {report['bound_s']:.4f} s "
          f"({report['bound_share_of_wall'] or 0:.1%} of wall)")
    print(f"device busy {report['device_busy_s']:.4f} s  idle {report['device_idle_s']:.4f} s  "
          f"host not hidden {report['host_not_hidden_s']:.4f} s")
    for kind, k in report["device_by_kind"].items():
        print(f"  {kind:<10} {k['steps']:>7} steps  device {k['device_s']:.4f} s  bound {k['bound_s']:.4f} s  "
              f"beyond {k['beyond_bound_s']:.4f} s")
    for cause, seconds in report["device_idle_by_cause"].items():
        print(f"  idle {cause:<10} {seconds:.4f} s ({seconds / wall:.1%} of wall)")
    graphs = report["decode_cuda_graph_share"]
    print(f"decode steps replaying a CUDA graph: {'-' if graphs is None else f'{graphs:.1%}'}")
    for key in ("prefill_chunk_tokens", "decode_batch_size"):
        s = report[key]
        if s["steps"]:
            print(f"{key}: {s['steps']} steps, mean {s['mean']:.1f}, p50 {s['p50']}, p90 {s['p90']}, max {s['max']}")


def ceilings_from(args: argparse.Namespace) -> Ceilings:
    shape = dict(layers=args.layers, q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 params_b=args.params_b)
    if args.model_config:
        derived = model_shape(args.model_config)
        shape.update({k: v for k, v in derived.items() if k != "params_b" or args.params_b is None})
    if shape["params_b"] is None:
        shape["params_b"] = 8.03
    return Ceilings(args.tflops, args.hbm_tbps, weight_bytes=args.weight_bytes, kv_bytes=args.kv_bytes,
                    attention_tflops=args.attention_tflops or args.tflops, **shape)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="the server's --step-trace file")
    p.add_argument("--run", type=int, default=-1, help="which run of a trace appended to several times (default: last)")
    p.add_argument("--bench-result", help="bench_serving's --output-file: its duration sets the window (the last "
                   "that many seconds, from the first step the scheduler started idle: its warm-up left out)")
    p.add_argument("--window-s", type=float, help="only the last S seconds of the trace (default: as the "
                   "--bench-result says, else everything)")
    p.add_argument("--tflops", type=float, default=790.0, help="peak TFLOP/s (H200 dense bf16: 790)")
    p.add_argument("--attention-tflops", type=float, help="attention's peak TFLOP/s (default: --tflops; with fp8 "
                   "weights give the bf16 peak here, attention stays in bf16)")
    p.add_argument("--hbm-tbps", type=float, default=4.25, help="memory bandwidth TB/s (H200: 4.8 spec, ~4.25 "
                   "reached)")
    p.add_argument("--params-b", type=float, help="parameters in billions (default: from --model-config, else 8.03)")
    p.add_argument("--weight-bytes", type=float, default=2.0, help="bytes per parameter")
    p.add_argument("--kv-bytes", type=float, help="bytes per KV element (default: the trace's pool, else 2)")
    p.add_argument("--model-config", help="a HF model folder or config.json: its shape and parameter count")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", help="JSON to write (default: TRACE's stem + _breakdown.json); the PNG goes beside it")
    args = p.parse_args(argv)

    header, steps = read_runs(args.trace)[args.run]
    if not steps:
        raise SystemExit(f"{args.trace}: the run has no steps")
    if args.kv_bytes is None:
        args.kv_bytes = float(header.get("kv_bytes", 2.0))
    ceilings = ceilings_from(args)
    bench = read_bench_result(args.bench_result) if args.bench_result else None
    window = args.window_s if args.window_s is not None else (bench or {}).get("duration")
    placed = in_window(place(steps), window)
    if args.window_s is None and bench is not None:
        placed = from_first_start(placed)
    report = {"trace": str(args.trace), "header": header, "window_s": window, "ceilings": asdict(ceilings),
              **breakdown(placed, ceilings)}
    if bench is not None:
        report["bench_serving"] = bench_comparison(bench, report)
    out = Path(args.out) if args.out else Path(args.trace).with_name(Path(args.trace).stem + "_breakdown.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(placed, report, out.with_suffix(".png"))
    print_report(report)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
