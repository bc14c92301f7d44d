"""The checks once the load stops: the server drains to idle with every KV slot free or only cached, /flush_cache
frees them all, and the idle scheduler does not burn CPU."""

from __future__ import annotations

import asyncio
import json
import time

import psutil

from soak_http import Http
from soak_server import cpu_s


async def drain(http: Http, timeout_s: float) -> dict:
    """Wait until nothing runs or waits and every KV slot is free or only cached; the last reading either way."""
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    while True:
        states = json.loads((await http.get("/get_server_info"))[1])["internal_states"]
        loads = json.loads((await http.get("/get_load"))[1])
        idle = all(
            s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
            and s["available_tokens"] + s["evictable_tokens"] == s["max_total_num_tokens"]
            for s in states
        ) and all(load["num_reqs"] == 0 and load["num_tokens"] == 0 for load in loads)
        if idle or time.monotonic() > deadline:
            keys = ("num_running_reqs", "num_waiting_reqs", "available_tokens", "evictable_tokens",
                    "max_total_num_tokens", "token_usage")
            return {"idle": idle, "drain_s": time.monotonic() - start,
                    "replicas": [{k: s[k] for k in keys} for s in states], "get_load": loads}
        await asyncio.sleep(0.2)


async def flush_and_count(http: Http) -> dict:
    """/flush_cache on the idle server, then every slot must be free: what the cache held was all it held."""
    status, _ = await http.post("/flush_cache", raw=b"")
    states = json.loads((await http.get("/get_server_info"))[1])["internal_states"]
    free = [(s["available_tokens"], s["max_total_num_tokens"]) for s in states]
    return {"flush_status": status, "available_vs_total": free,
            "all_free": status == 200 and all(a == t for a, t in free)}


async def idle_cpu_s(proc: psutil.Process | None, window_s: float) -> float | None:
    """CPU seconds (user + system) the process spends over `window_s` of idleness."""
    if proc is None:
        return None
    try:
        before = cpu_s(proc)
        await asyncio.sleep(window_s)
        return cpu_s(proc) - before
    except psutil.Error:
        return None
