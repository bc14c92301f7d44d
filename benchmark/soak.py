"""Bounded soak test of a server on this machine: many concurrent clients send a seeded mix of good requests,
hang-ups, aborts and bad inputs for a fixed time; then the server must be idle again with its KV pool whole.

    python benchmark/soak.py [--model-path DIR] [--duration 120] [--clients 64] [--output FILE] [-- SERVER FLAGS]
    python benchmark/soak.py --url http://127.0.0.1:30000 [--server-pid PID] ...

Without `--url` it starts `python -m sglang_pic.launch_server` on a free loopback port (no `--model-path`: the
embedded Qwen2.5-Coder-0.5B-Instruct); everything after `--` goes to the server. It only ever talks to loopback.

Each client loops over request kinds drawn from a seeded mix: native /generate (plain, span-marked and input_ids
prompts, streamed or not), /v1/completions, /v1/chat/completions (with `tools` and `tool_spans` where the chat
template renders tools and they fit the context), constrained decoding (where the server has a grammar backend),
clients that hang up after the first streamed chunk, explicit aborts by rid, and bad inputs that must get a 4xx.
Client i sends kind i first, so with at least as many clients as kinds every kind is sent. Every request has a
generous client timeout; one that reaches it is hung. After the clients stop it waits for the server to drain and reads
/get_server_info and /get_load: nothing running or waiting, free + evictable KV slots = the pool, and after
/flush_cache every slot free. It also reports the scheduler process's RSS before and after, and its CPU time over
a few idle seconds (a polling loop that spins burns a core).

Must-hold figures (the exit code is 1 if any fails): no 5xx, no hung request, no transport error, every bad input a
4xx and every good request a 2xx with a well-formed body, the KV accounting idle after the drain, the idle
scheduler's CPU under `--idle-cpu-limit`, and the server still alive.

This file runs the load; its parts sit beside it: soak_workload.py (what is sent), soak_client.py (the request
kinds), soak_replies.py (what a good reply is), soak_checks.py (the checks after the load), soak_server.py (the
server's processes), soak_http.py and soak_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from soak_checks import drain, flush_and_count, idle_cpu_s
from soak_client import Client, KindFn, request_kinds
from soak_http import Http, loopback_url
from soak_report import KindStats, Outcome, clip, format_report
from soak_server import OwnServer, cpu_or_none, growth, listener_pid, rss_mib, scheduler_process
from soak_workload import build_workload


@dataclass
class SoakConfig:
    url: str
    clients: int = 64
    duration_s: float = 60.0
    max_requests: int | None = None
    seed: int = 0
    request_timeout_s: float = 60.0  # a request still unanswered after this is hung
    max_new_tokens: int = 16
    max_prompt_tokens: int = 160
    drain_timeout_s: float = 60.0
    idle_cpu_window_s: float = 3.0
    idle_cpu_limit_s: float = 0.5
    progress_interval_s: float = 5.0


async def probe(http: Http, path: str, body: dict) -> str:
    """"" when the server serves `body` with a 200, else why not (its message)."""
    status, raw = await http.post(path, body)
    return "" if status == 200 else f"{status}: {raw[:300].decode(errors='replace')}"


class Soak:
    def __init__(self, config: SoakConfig, server_pid: int | None) -> None:
        self.config = config
        self.server_pid = server_pid
        self.scheduler = scheduler_process(server_pid)
        self.stats: dict[str, KindStats] = defaultdict(KindStats)
        self.examples: list[dict] = []  # the first failures, for the report
        self.issued = 0
        self.in_flight = 0
        self.deadline = 0.0
        self.rss_series: list[tuple[float, float | None]] = []

    def take_ticket(self) -> bool:
        if time.monotonic() >= self.deadline:
            return False
        if self.config.max_requests is not None and self.issued >= self.config.max_requests:
            return False
        self.issued += 1
        return True

    async def run_one(self, kind: str, send: KindFn, client: Client, rng: random.Random) -> Outcome:
        start = time.monotonic()
        self.in_flight += 1
        try:
            status, failure, aborted = await send(client, rng)
            out = Outcome(kind, status, time.monotonic() - start, failure, aborted=aborted)
        except TimeoutError:
            elapsed = time.monotonic() - start
            out = Outcome(kind, None, elapsed, f"hung: no full reply in {elapsed:.0f} s", hung=True)
        except aiohttp.ClientError as e:
            out = Outcome(kind, None, time.monotonic() - start, f"transport: {type(e).__name__}: {e}",
                          transport_error=True)
        finally:
            self.in_flight -= 1
        self.stats[kind].add(out)
        if out.failure and len(self.examples) < 20:
            self.examples.append({"kind": kind, "status": out.status, "failure": out.failure,
                                  "request": clip(client.request), "reply": clip(client.reply)})
        return out

    async def client_loop(self, client: Client, kinds: dict[str, tuple[float, KindFn]]) -> None:
        """Client i first sends kind i (so with as many clients as kinds every kind is sent), then the mix."""
        rng = random.Random(self.config.seed * 100_003 + client.id)
        names = list(kinds)
        weights = [kinds[n][0] for n in names]
        kind = names[client.id % len(names)]
        while self.take_ticket():
            await self.run_one(kind, kinds[kind][1], client, rng)
            kind = rng.choices(names, weights)[0]

    async def progress(self, start: float) -> None:
        while True:
            await asyncio.sleep(self.config.progress_interval_s)
            elapsed = time.monotonic() - start
            self.rss_series.append((round(elapsed, 1), rss_mib(self.scheduler)))
            totals = self.totals()
            print(
                f"[soak] {elapsed:5.0f}s/{self.config.duration_s:.0f}s  requests {self.issued} "
                f"({self.issued / elapsed:.1f}/s)  in flight {self.in_flight}  5xx {totals['5xx']}  "
                f"hung {totals['hung']}  failures {totals['failures']}",
                file=sys.stderr, flush=True,
            )

    def totals(self) -> dict:
        keys = ("count", "2xx", "4xx", "5xx", "hung", "transport_errors", "failures", "aborted")
        summaries = [s.summary() for s in self.stats.values()]
        return {k: sum(s[k] for s in summaries) for k in keys}

    async def run(self) -> dict:
        cfg = self.config
        http = Http(cfg.url, cfg.request_timeout_s, cfg.clients + 8)
        try:
            return await self._run(http)
        finally:
            await http.close()

    async def _run(self, http: Http) -> dict:
        cfg = self.config
        info = json.loads((await http.get("/get_server_info"))[1])
        work = await build_workload(http, cfg.seed, cfg.max_prompt_tokens, cfg.max_new_tokens, info["context_len"])
        skipped = {
            "constrained": await probe(http, "/generate", {"text": "hi", "sampling_params": {
                "max_new_tokens": 1, "regex": "[ab]"}}),
            "tools": work.tools_skipped,
        }
        kinds = request_kinds(grammar=not skipped["constrained"], tools=not skipped["tools"])
        await drain(http, cfg.drain_timeout_s)
        rss_start, cpu_start = rss_mib(self.scheduler), cpu_or_none(self.scheduler)
        start = time.monotonic()
        self.deadline = start + cfg.duration_s
        ticker = asyncio.create_task(self.progress(start))
        clients = [Client(http, work, i) for i in range(cfg.clients)]
        await asyncio.gather(*(self.client_loop(c, kinds) for c in clients))
        load_s = time.monotonic() - start
        load_cpu = growth(cpu_start, cpu_or_none(self.scheduler))
        ticker.cancel()
        try:
            kv = await drain(http, cfg.drain_timeout_s)
            idle_cpu = await idle_cpu_s(self.scheduler, cfg.idle_cpu_window_s)
            rss_end = rss_mib(self.scheduler)
            flushed = await flush_and_count(http)
            alive = (await http.get("/health"))[0] == 200
        except (TimeoutError, aiohttp.ClientError) as e:  # the server died or stopped answering
            unreachable = {"idle": False, "all_free": False, "error": f"{type(e).__name__}: {e}"}
            kv, idle_cpu, rss_end, flushed, alive = unreachable, None, None, unreachable, False
        totals = self.totals()
        checks = {
            "no_5xx": totals["5xx"] == 0,
            "no_hung": totals["hung"] == 0,
            "no_transport_errors": totals["transport_errors"] == 0,
            "every_request_as_expected": totals["failures"] == 0,
            "kv_idle_after_drain": kv["idle"],
            "kv_free_after_flush": flushed["all_free"],
            "idle_scheduler_cpu": idle_cpu is None or idle_cpu < cfg.idle_cpu_limit_s,
            "server_alive": alive,
        }
        return {
            "config": asdict(cfg),
            "server_pid": self.server_pid,
            "skipped_kinds": {k: v for k, v in skipped.items() if v},
            "load_s": load_s,
            "requests": totals["count"],
            "requests_per_s": totals["count"] / load_s,
            "totals": totals,
            "kinds": {k: self.stats[k].summary() for k in sorted(self.stats)},
            "kv_after_drain": kv,
            "kv_after_flush": flushed,
            "scheduler": {
                "pid": self.scheduler.pid if self.scheduler else None,
                "rss_start_mib": rss_start,
                "rss_end_mib": rss_end,
                "rss_growth_mib": growth(rss_start, rss_end),
                # from the first progress tick on: what the run adds once caches and pools have warmed up
                "rss_growth_after_first_tick_mib": growth(self.rss_series[0][1] if self.rss_series else None, rss_end),
                "rss_series_mib": self.rss_series,
                # CPU seconds the scheduler got while the clients ran: far below load_s times its threads on a
                # busy machine means it waited for cores, which explains a slow run
                "load_cpu_s": load_cpu,
                "idle_cpu_s": idle_cpu,
                "idle_cpu_window_s": cfg.idle_cpu_window_s,
            },
            "failure_examples": self.examples,
            "checks": checks,
            "passed": all(checks.values()),
        }


async def run_soak(config: SoakConfig, server_pid: int | None = None) -> dict:
    return await Soak(config, server_pid).run()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Soak flags, and the server flags after `--`."""
    own, server_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server, http://127.0.0.1:PORT (default: start one)")
    p.add_argument("--server-pid", type=int, help="with --url: its main process (default: the port's listener)")
    p.add_argument("--model-path", help="for the server started here (default: the embedded model)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--max-requests", type=int, help="stop after this many requests (default: no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=60.0, help="a request unanswered this long is hung")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=160)
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--idle-cpu-limit", type=float, default=0.5, help="CPU seconds the idle scheduler may use in 3 s")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--server-log", type=Path, help="where the started server logs (default: a temp file)")
    p.add_argument("--output", type=Path, help="write the report as JSON here")
    args = p.parse_args(own)
    if args.url and (args.model_path or server_flags):
        p.error("--url targets a running server: --model-path and server flags are for the one soak.py starts")
    return args, server_flags


def main(argv: list[str] | None = None) -> int:
    args, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    server = None
    if args.url:
        url = loopback_url(args.url)
        pid = args.server_pid or listener_pid(urlsplit(url).port)
    else:
        log = args.server_log or Path(tempfile.mkstemp(prefix="soak_server_", suffix=".log")[1])
        server = OwnServer(args.model_path, server_flags, log, args.startup_timeout)
        print(f"[soak] starting the server on {server.url} (log: {log})", file=sys.stderr, flush=True)
        server.wait_healthy()
        url, pid = server.url, server.proc.pid
    config = SoakConfig(
        url=url, clients=args.clients, duration_s=args.duration, max_requests=args.max_requests, seed=args.seed,
        request_timeout_s=args.request_timeout, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, drain_timeout_s=args.drain_timeout,
        idle_cpu_limit_s=args.idle_cpu_limit,
    )
    try:
        report = asyncio.run(run_soak(config, pid))
    finally:
        if server is not None:
            server.stop()
    print(format_report(report))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
