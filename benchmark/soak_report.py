"""The soak's tally and report: each request's outcome, per-kind counts and latency percentiles, and the text
summary printed at the end."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

LATENCY_PERCENTILES = (0.5, 0.99)


@dataclass
class Outcome:
    kind: str
    status: int | None  # HTTP status; None when no response arrived
    latency_s: float
    failure: str = ""  # why this request breaks the soak's rules ("" = it kept them)
    hung: bool = False
    transport_error: bool = False
    aborted: bool = False  # finished with finish_reason abort (the abort kinds)


@dataclass
class KindStats:
    count: int = 0
    status: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    hung: int = 0
    transport_errors: int = 0
    failures: int = 0
    aborted: int = 0
    latencies: list[float] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        self.count += 1
        if out.status is not None:
            self.status[f"{out.status // 100}xx"] += 1
        self.hung += out.hung
        self.transport_errors += out.transport_error
        self.failures += bool(out.failure)
        self.aborted += out.aborted
        if not out.hung:
            self.latencies.append(out.latency_s)

    def summary(self) -> dict:
        ordered = sorted(self.latencies)
        pct = {f"p{round(q * 100)}_s": percentile(ordered, q) for q in LATENCY_PERCENTILES}
        return {
            "count": self.count,
            **{key: self.status.get(key, 0) for key in ("2xx", "4xx", "5xx")},
            "hung": self.hung,
            "transport_errors": self.transport_errors,
            "failures": self.failures,
            "aborted": self.aborted,
            **pct,
        }


def clip(value: object, limit: int = 2000) -> str:
    text = value.decode(errors="replace") if isinstance(value, bytes) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def percentile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def format_report(report: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    cols = ("count", "2xx", "4xx", "5xx", "hung", "transport_errors", "failures", "aborted")
    header = f"{'kind':26}" + "".join(f"{c[:9]:>10}" for c in cols) + f"{'p50 ms':>10}{'p99 ms':>10}"
    lines = [header, "-" * len(header)]
    for kind, s in report["kinds"].items():
        lines.append(f"{kind:26}" + "".join(f"{s[c]:>10}" for c in cols) + f"{ms(s['p50_s']):>10}{ms(s['p99_s']):>10}")
    t = report["totals"]
    lines.append(f"{'total':26}" + "".join(f"{t[c]:>10}" for c in cols))
    sched, kv, flushed = report["scheduler"], report["kv_after_drain"], report["kv_after_flush"]
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines += [
        "",
        f"requests {report['requests']} in {report['load_s']:.1f} s ({report['requests_per_s']:.1f}/s)",
        f"skipped kinds: {report['skipped_kinds'] or 'none'}",
        f"KV after drain: idle {kv['idle']}, {kv.get('replicas', kv.get('error'))}",
        f"KV after flush (available, total): {flushed.get('available_vs_total', flushed.get('error'))}",
        f"scheduler pid {sched['pid']}: RSS {fmt(sched['rss_start_mib'], '.1f')} -> {fmt(sched['rss_end_mib'], '.1f')}"
        f" MiB (growth {fmt(sched['rss_growth_mib'], '+.1f')}, after the first tick "
        f"{fmt(sched['rss_growth_after_first_tick_mib'], '+.1f')}), CPU under load {fmt(sched['load_cpu_s'], '.1f')}"
        f" s, idle CPU {fmt(sched['idle_cpu_s'], '.3f')} s over {sched['idle_cpu_window_s']:.0f} s",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in report["checks"].items()),
    ]
    for e in report["failure_examples"]:
        lines += [f"  FAILED {e['kind']} ({e['status']}): {e['failure']}", f"    request: {e['request'][:400]}",
                  f"    reply: {e['reply'][:400]}"]
    return "\n".join(lines)
