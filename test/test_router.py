"""Scale-out behind the real sglang-router: a `--tp-size 2` server and a `--dp-size 2` server on loopback ports.

Requests through the router (generate, stream, flush, cache-aware routing, SGLang's `select`) must give what the
servers give directly; the two servers must agree with each other (tensor- and data-parallel paths alike).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import sglang_router  # noqa: F401  (the package under test: fail loudly if it is missing)

from server_utils import ServerProcess, free_port, spawn_server, stop_server, wait_healthy
from sglang_pic.frontend_lang.markers import span

pytestmark = pytest.mark.slow  # a tp 2 server, a dp 2 server and two routers

ROUTER_START_S = 60.0
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PREFIX = "Once upon a time there was a little town by the sea where fishermen told stories every night."
PROMPTS = [
    "The quick brown fox",
    PREFIX + " The weather today",
    "Answer briefly." + span("The capital of France is Paris.") + "Where is Paris?",
]


@dataclass
class Router:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, timeout=120, **kw)


def start_router(worker_urls: list[str], *extra: str, targets: int | None = None) -> Router:
    """Start sglang-router and wait until it sees `targets` healthy workers (default: one per URL)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
        "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
        "--policy", "cache_aware", "--log-level", "warn", "--shutdown-grace-period-secs", "1", *extra,
    ]
    log = tempfile.NamedTemporaryFile(prefix="sglang_router_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, f"http://127.0.0.1:{port}", Path(log.name))
    deadline = time.monotonic() + ROUTER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with code {proc.returncode}:\n{router.log_path.read_text()[-3000:]}")
        try:
            ready = requests.get(router.url + "/readiness", timeout=1)
            if ready.status_code == 200 and ready.json().get("healthy_workers") == (targets or len(worker_urls)):
                return router
        except requests.ConnectionError:
            pass
        time.sleep(0.25)
    stop_router(router)
    raise RuntimeError(f"router did not see its workers in {ROUTER_START_S}s:\n{router.log_path.read_text()[-3000:]}")


def stop_router(router: Router) -> None:
    if router.proc.poll() is None:
        router.proc.send_signal(signal.SIGTERM)
        try:
            router.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(router.proc.pid, signal.SIGKILL)
            router.proc.wait()


@dataclass
class Cluster:
    tp_server: ServerProcess
    dp_server: ServerProcess
    router: Router  # over both servers
    dp_aware_router: Router  # over the dp server, one routing target per replica


@pytest.fixture(scope="module")
def cluster(tiny_llama) -> Cluster:
    servers = [spawn_server(tiny_llama, "--tp-size", "2"), spawn_server(tiny_llama, "--dp-size", "2")]
    routers: list[Router] = []
    try:
        for server in servers:
            wait_healthy(server)
        routers.append(start_router([s.url for s in servers]))
        routers.append(start_router([servers[1].url], "--dp-aware", targets=2))
        yield Cluster(*servers, *routers)
    finally:
        for router in routers:
            stop_router(router)
        for server in servers:
            stop_server(server)


def generate(target, body: dict) -> dict | list[dict]:
    res = target.post("/generate", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def replica_prompt_tokens(server: ServerProcess) -> list[int]:
    return [s["prompt_tokens"] for s in server.get("/get_server_info").json()["internal_states"]]


def test_generate_through_router_matches_direct(cluster):
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": GREEDY}
        direct = generate(cluster.tp_server, body)
        assert generate(cluster.dp_server, body)["output_ids"] == direct["output_ids"]
        routed = generate(cluster.router, body)
        assert (routed["text"], routed["output_ids"]) == (direct["text"], direct["output_ids"])
    ids_body = {"input_ids": [[5, 17, 42, 99], [250, 3, 77]], "sampling_params": GREEDY}
    routed = [o["output_ids"] for o in generate(cluster.router, ids_body)]
    assert routed == [o["output_ids"] for o in generate(cluster.tp_server, ids_body)]


def test_stream_through_router(cluster):
    body = {"text": PROMPTS[2], "sampling_params": GREEDY}
    expected = generate(cluster.tp_server, body)["text"]
    stream_body = {**body, "stream": True}
    with requests.post(cluster.router.url + "/generate", json=stream_body, stream=True, timeout=120) as res:
        assert res.status_code == 200
        events = [line[len(b"data: ") :] for line in res.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1 and chunks[-1]["text"] == expected


def test_flush_through_router_reaches_every_worker(cluster):
    body = {"text": PREFIX + " The children", "sampling_params": GREEDY, "data_parallel_rank": 0}
    for server in (cluster.tp_server, cluster.dp_server):
        generate(server, body)
        assert generate(server, body)["meta_info"]["cached_tokens"] > 10
    res = cluster.router.post("/flush_cache")
    assert res.status_code == 200 and res.json()["workers_flushed"] == 2, res.text
    for server in (cluster.tp_server, cluster.dp_server):
        assert generate(server, body)["meta_info"]["cached_tokens"] == 0


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(cluster):
    """With --dp-aware the router routes to replicas (sending data_parallel_rank): a shared prefix stays on one."""
    before = replica_prompt_tokens(cluster.dp_server)
    outs = [
        generate(cluster.dp_aware_router, {"text": PREFIX + suffix, "sampling_params": GREEDY})
        for suffix in (" The weather", " She opened the old book", " Numbers like one", " He said hello")
    ]
    assert all(o["meta_info"]["cached_tokens"] > 10 for o in outs[1:])
    grown = [after - b for after, b in zip(replica_prompt_tokens(cluster.dp_server), before)]
    assert sorted(grown)[0] == 0 and sorted(grown)[1] == sum(o["meta_info"]["prompt_tokens"] for o in outs)


def test_data_parallel_rank_picks_the_replica(cluster):
    before = replica_prompt_tokens(cluster.dp_server)
    out = generate(cluster.dp_server, {"text": PROMPTS[0], "sampling_params": GREEDY, "data_parallel_rank": 1})
    after = replica_prompt_tokens(cluster.dp_server)
    assert after[0] == before[0] and after[1] == before[1] + out["meta_info"]["prompt_tokens"]
    bad = cluster.dp_server.post("/generate", json={"text": "x", "data_parallel_rank": 2})
    assert bad.status_code == 400 and "data_parallel_rank" in bad.text


def test_router_refuses_batched_text(cluster):
    """The known limit RouterEndpoint works around: sglang-router takes one `text` per /generate."""
    res = cluster.router.post("/generate", json={"text": ["a", "b"], "sampling_params": GREEDY})
    assert res.status_code == 422


def test_select_through_router(cluster):
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from sglang_pic.frontend_lang.router_endpoint import RouterEndpoint

    @sgl.function
    def pick(s):
        s += "The quick brown fox" + span("The capital of France is Paris.") + " jumps over the"
        s += sgl.select("animal", choices=[" lazy dog", " farmer", " sea"])
        s += sgl.gen("tail", max_tokens=4, temperature=0)

    direct = pick.run(backend=RuntimeEndpoint(cluster.tp_server.url))
    routed = pick.run(backend=RouterEndpoint(cluster.router.url))
    assert (routed["animal"], routed["tail"]) == (direct["animal"], direct["tail"])
    scores = routed.get_meta_info("animal")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(direct.get_meta_info("animal")["normalized_prompt_logprobs"], abs=1e-4)
