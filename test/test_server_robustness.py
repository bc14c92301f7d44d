"""The server under abuse: bad inputs get a 400 naming the problem and the server keeps serving; the API key
guards every route but /health; 32 concurrent streaming clients, some leaving mid-stream, all get complete output
and the KV pool returns to idle; SIGTERM stops every process; a dead child takes the server down and fails the
requests in flight."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from server_utils import child_pids, pid_alive, start_server, stop_server

API_KEY = "sk-test-key"
GOOD = {"text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
TOO_LONG = "hello world " * 300  # the tiny models' context is 256 tokens
HANG_S = 120  # waits for the server's own bounded shutdown; only a hang runs out of it


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(tiny_llama, api_key=API_KEY)
    yield srv
    stop_server(srv)


def assert_good_request_works(server) -> None:
    resp = server.post("/generate", json=GOOD)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == 4


NATIVE_BAD = [
    ("malformed json", b"{bad json", "malformed JSON"),
    ("not an object", json.dumps([1, 2]).encode(), "JSON object"),
    ("unknown field", json.dumps({"text": "hi", "temprature": 0}).encode(), "temprature"),
    ("wrong text type", json.dumps({"text": 123}).encode(), "text"),
    ("no prompt", json.dumps({"sampling_params": {}}).encode(), "text or input_ids"),
    ("wrong param type", json.dumps({"text": "hi", "sampling_params": {"temperature": "hot"}}).encode(), "temperature"),
    ("out of range", json.dumps({"text": "hi", "sampling_params": {"top_p": 2}}).encode(), "top_p"),
    ("unknown param", json.dumps({"text": "hi", "sampling_params": {"max_tokens": 3}}).encode(), "max_tokens"),
    ("negative max", json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": -1}}).encode(), "max_new_tokens"),
    ("ids outside vocab", json.dumps({"input_ids": [5, 999999]}).encode(), "999999"),
    ("prompt too long", json.dumps({"text": TOO_LONG}).encode(), "context length"),
    ("stream not bool", json.dumps({"text": "hi", "stream": "yes"}).encode(), "stream"),
    ("bad logprob start", json.dumps({"text": "hi", "logprob_start_len": -5}).encode(), "logprob_start_len"),
    ("bad regex", json.dumps({"text": "hi", "sampling_params": {"regex": "(a+"}}).encode(), "regex is not valid"),
    ("bad json_schema", json.dumps({"text": "hi", "sampling_params": {"json_schema": "{"}}).encode(), "json_schema"),
    ("two grammars", json.dumps({"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}).encode(),
     "at most one"),
    ("bad stop_regex", json.dumps({"text": "hi", "sampling_params": {"stop_regex": "a["}}).encode(),
     "stop_regex"),
    ("empty batch", json.dumps({"text": []}).encode(), "empty"),
    ("duplicate rid", json.dumps({"text": ["a", "b"], "rid": ["x", "x"]}).encode(), "unique"),
    ("token ids logprob outside vocab", json.dumps({"text": "hi", "return_logprob": True,
                                                    "token_ids_logprob": [3, 999999]}).encode(), "token_ids_logprob"),
    ("token ids logprob without logprobs", json.dumps({"text": "hi", "token_ids_logprob": [3]}).encode(),
     "needs return_logprob"),
    ("token ids logprob per prompt", json.dumps({"text": ["a", "b"], "return_logprob": True,
                                                 "token_ids_logprob": [[3]]}).encode(), "one entry per prompt"),
    ("priority not an integer", json.dumps({"text": "hi", "priority": "high"}).encode(), "priority"),
]


@pytest.mark.parametrize("case,body,needle", NATIVE_BAD, ids=[c[0] for c in NATIVE_BAD])
def test_native_bad_input_is_400(server, case, body, needle):
    resp = server.post("/generate", data=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert needle.lower() in message.lower(), message
    assert_good_request_works(server)


def test_native_bad_stream_request_is_400_before_streaming(server):
    body = {"text": "hi", "stream": True, "sampling_params": {"temperature": -1}}
    resp = server.post("/generate", json=body)
    assert resp.status_code == 400
    assert "temperature" in resp.json()["error"]["message"]


OPENAI_BAD = [
    ("/v1/completions", b"{oops", "malformed JSON"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "logprobs": 50}).encode(), "logprobs"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "warm"}).encode(), "temperature"),
    ("/v1/completions", json.dumps({"prompt": "hi", "bogus": 1}).encode(), "bogus"),
    ("/v1/completions", json.dumps({"prompt": TOO_LONG}).encode(), "context length"),
    ("/v1/completions", json.dumps({"prompt": "hi", "top_p": 0}).encode(), "top_p"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), "n"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": TOO_LONG}]}).encode(), "context"),
]


@pytest.mark.parametrize("path,body,needle", OPENAI_BAD, ids=[f"{p}-{n}" for p, _, n in OPENAI_BAD])
def test_openai_bad_input_is_400(server, path, body, needle):
    resp = server.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert set(resp.json()) == {"error"}, resp.text
    err = resp.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and "param" in err
    assert needle.lower() in err["message"].lower(), err["message"]
    if needle == "temperature":
        assert err["param"] == "temperature"
    ok = server.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_api_key_guards_all_but_health(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    for method, path in (("post", "/generate"), ("get", "/get_model_info"), ("get", "/v1/models"), ("get", "/metrics")):
        resp = getattr(requests, method)(server.url + path, json=GOOD, timeout=10)
        assert resp.status_code == 401, path
        wrong = getattr(requests, method)(
            server.url + path, json=GOOD, headers={"Authorization": "Bearer nope"}, timeout=10
        )
        assert wrong.status_code == 401, path
        err = resp.json()["error"]
        if path.startswith("/v1/"):
            assert err["type"] == "AuthenticationError" and err["code"] == 401 and "API key" in err["message"]
        else:
            assert set(err) == {"message"} and "API key" in err["message"]
    assert server.get("/get_model_info").status_code == 200


def kv_state(server) -> dict:
    return server.get("/get_server_info").json()["internal_states"][0]


def generated_tokens(server) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("sglang:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no generation counter")


def wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = kv_state(server)
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            return state
        time.sleep(0.1)
    raise AssertionError(f"server still busy: {state}")


def test_concurrent_streams_with_disconnects(server):
    assert server.post("/flush_cache").status_code == 200
    idle = kv_state(server)
    assert idle["available_tokens"] == idle["max_total_num_tokens"]
    tokens_before = generated_tokens(server)

    clients, keep_tokens, leave_tokens = 32, 24, 200
    leavers = set(range(0, clients, 4))  # 8 clients hang up after their second chunk
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            body = {
                "text": f"Client {i} says: once upon a time",
                "sampling_params": {
                    "temperature": 0,
                    "ignore_eos": True,
                    "max_new_tokens": leave_tokens if i in leavers else keep_tokens,
                },
                "stream": True,
            }
            resp = server.post("/generate", json=body, stream=True)
            assert resp.status_code == 200
            events = []
            for line in resp.iter_lines(decode_unicode=True):
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if i in leavers and len(events) == 2:
                    resp.close()
                    break
            results[i] = events
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(clients):
        if i in leavers:
            assert len(results[i]) == 2
            continue
        events = results[i]
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        assert final["meta_info"]["completion_tokens"] == keep_tokens
        assert len(final["output_ids"]) == keep_tokens

    state = wait_idle(server)
    # Leavers were aborted, not run to their 200 tokens.
    survivors = clients - len(leavers)
    assert generated_tokens(server) - tokens_before < survivors * keep_tokens + len(leavers) * leave_tokens / 2
    # Everything finished went to the cache: nothing is held by a request any more.
    assert state["token_usage"] == 0
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]
    assert server.post("/flush_cache").status_code == 200
    assert kv_state(server)["available_tokens"] == idle["available_tokens"]
    assert_good_request_works(server)


def test_non_streaming_client_timeout_aborts(server):
    wait_idle(server)
    before = generated_tokens(server)
    # 512 long generations need thousands of decode steps through the small KV pool: many seconds on any CPU,
    # while the client gives up after half a second.
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 230, "n": 8}
    body = {"text": [f"Once upon a time {i}" for i in range(64)], "sampling_params": params}
    with pytest.raises(requests.ReadTimeout):
        server.post("/generate", json=body, timeout=0.5)
    wait_idle(server)
    assert generated_tokens(server) - before < 64 * 8 * 230 / 2  # cut short, not run to the end
    assert kv_state(server)["token_usage"] == 0


def test_sigterm_stops_every_process(server):
    """Runs last in this module: it stops the shared server."""
    children = child_pids(server.pid)
    assert len(children) >= 2
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(HANG_S)
    deadline = time.monotonic() + HANG_S
    while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in children)
    assert server.proc.returncode == 0


@pytest.mark.slow
def test_dead_child_takes_server_down(tiny_llama):
    """Children start as [scheduler, detokenizer] (pids grow). Requests in flight when the scheduler dies get an
    error (a stream: its end cut off), not a hang; the server logs which process died and exits non-zero, stopping
    the detokenizer. (Any child's death takes the same path: launch_server.ChildWatcher.)"""
    srv = start_server(tiny_llama)
    try:
        workers = sorted(
            p for p in child_pids(srv.pid) if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
        )
        assert len(workers) == 2
        long = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 230}
        replies = []
        # 9 requests of 235 tokens fit the 4096-token pool at once: the stream is not queued behind the batch.
        batch = {"text": [f"Once upon a time {i}" for i in range(8)], "sampling_params": long}
        waiter = threading.Thread(target=lambda: replies.append(srv.post("/generate", json=batch)))
        waiter.start()
        deadline = time.monotonic() + 60
        while srv.get("/get_load").json()[0]["num_reqs"] < 8:
            assert time.monotonic() < deadline and waiter.is_alive(), replies
            time.sleep(0.02)
        stream = srv.post("/generate", json={"text": "Hello", "sampling_params": long, "stream": True}, stream=True)
        events = (line for line in stream.iter_lines(decode_unicode=True) if line.startswith("data: "))
        next(events)  # both requests are in flight now
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            list(events)  # the stream stops without its final output and [DONE]
        waiter.join(60)
        assert replies and replies[0].status_code == 500, replies
        assert f"the scheduler process (pid {workers[0]}) exited unexpectedly" in replies[0].text
        srv.proc.wait(HANG_S)
        assert srv.proc.returncode != 0
        assert f"the scheduler process (pid {workers[0]}) exited unexpectedly" in srv.log_path.read_text()
        deadline = time.monotonic() + HANG_S
        while pid_alive(workers[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(workers[1])
    finally:
        stop_server(srv)


@pytest.mark.slow  # its own server and long requests
def test_full_queue_is_503_and_the_server_keeps_serving(tiny_llama):
    """With one request served at a time and one allowed to wait, a third gets a 503 naming the limit (native and
    OpenAI routes) while the two go on; once they finish, requests are taken again."""
    srv = start_server(tiny_llama, "--max-running-requests", "1", "--max-queued-requests", "1")
    try:
        long = {"temperature": 0, "max_new_tokens": 230, "ignore_eos": True}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(3):  # two 230-token requests in a row take over a second; retry if they beat the check
            results = []
            threads = [
                threading.Thread(target=lambda i=i: results.append(
                    srv.post("/generate", json={"text": f"Once upon a time {i}", "sampling_params": long}).json()
                ))
                for i in range(2)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while srv.get("/get_load").json()[0]["num_reqs"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            native = srv.post("/generate", json=GOOD)
            openai_reply = srv.post("/v1/chat/completions", json=chat)
            for t in threads:
                t.join(60)
            if all(r["meta_info"]["completion_tokens"] == 230 for r in results) and native.status_code == 503:
                break
        assert native.status_code == 503 and "--max-queued-requests" in native.json()["error"]["message"]
        assert openai_reply.status_code == 503 and "retry later" in openai_reply.json()["error"]["message"]
        assert srv.post("/generate", json=GOOD).status_code == 200
    finally:
        stop_server(srv)
