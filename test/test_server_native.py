"""SGLang's native HTTP API against a tiny-model server: /generate (single, batch, ids, streaming, logprobs,
prefill-only), abort, and the information and admin routes."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from server_utils import start_server, stop_server

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.frontend_lang.markers import SSEP_MARKER

PROMPTS = ["The quick brown fox", "Once upon a time there was a little town"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096) as eng:
        yield eng


def sse_events(resp: requests.Response) -> list:
    """The JSON payloads of a `data: ...` stream, with the final `[DONE]` kept as the string itself."""
    events = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_matches_engine(server, engine):
    expected = engine.generate(PROMPTS, GREEDY)
    single = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert single["text"] == expected[0]["text"]
    assert single["output_ids"] == expected[0]["output_ids"]
    assert set(single["meta_info"]) == set(expected[0]["meta_info"])
    assert single["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    assert single["meta_info"]["completion_tokens"] == 8

    batch = server.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in expected]

    ids = engine.tokenizer.encode(PROMPTS[1])
    by_ids = server.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == expected[1]["output_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_stream_is_cumulative_and_ends_with_done(server):
    full = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    resp = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "stream": True}, stream=True)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_batch_stream_and_n_carry_index(server):
    body = {"text": PROMPTS, "sampling_params": GREEDY, "stream": True}
    chunks = sse_events(server.post("/generate", json=body, stream=True))[:-1]
    assert {c["index"] for c in chunks} == {0, 1}
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert len(finals) == 2

    sampled = {"temperature": 1.0, "max_new_tokens": 4, "n": 3, "seed": 7}
    outs = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": sampled}).json()
    assert isinstance(outs, list) and len(outs) == 3


def test_logprobs_match_engine(server, engine):
    kwargs = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True}
    expected = engine.generate(PROMPTS[0], GREEDY, **kwargs)["meta_info"]
    got = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, **kwargs}).json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [t[1:] for t in got[key]] == [t[1:] for t in expected[key]]
        for (a, *_), (b, *_) in zip(got[key], expected[key]):
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-4)
    assert got["input_token_logprobs"][0][0] is None
    assert len(got["input_token_logprobs"]) == got["prompt_tokens"]
    assert all(len(row) == 2 for row in got["output_top_logprobs"])
    # token_ids_logprob crosses the process boundary: prompt rows from the header, output rows from the deltas
    asked = {**kwargs, "token_ids_logprob": [7, 3]}
    expected = engine.generate(PROMPTS[0], GREEDY, **asked)["meta_info"]
    got = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, **asked}).json()["meta_info"]
    for key in ("input_token_ids_logprobs", "output_token_ids_logprobs"):
        assert len(got[key]) == len(expected[key]) > 0
        for a, b in zip(got[key], expected[key]):
            assert (a is None and b is None) or (
                [t[1:] for t in a] == [t[1:] for t in b] and [t[0] for t in a] == pytest.approx([t[0] for t in b])
            )


def test_prefill_only_request(server):
    out = server.post("/generate", json={"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["meta_info"]["prompt_tokens"] > 0
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["text"] == "" and out["output_ids"] == []


LONG = {"temperature": 0, "max_new_tokens": 230, "ignore_eos": True}


def aborted_stream(server, attempt: int) -> dict:
    """Stream a long request, abort it by rid after its first chunk; return the final event's meta_info."""
    rid = f"abort-me-{attempt}"
    resp = server.post(
        "/generate", json={"text": PROMPTS[0], "rid": rid, "sampling_params": LONG, "stream": True}, stream=True
    )
    lines = resp.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
    assert server.post("/abort_request", json={"rid": rid}).status_code == 200
    rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    return json.loads(rest[-2])["meta_info"]


def test_abort_request_ends_stream(server):
    # On a loaded 2-core CI box a tiny model can finish before the abort lands; a few tries make that race
    # vanishingly rare while a broken abort still fails every try.
    metas = []
    for attempt in range(3):
        metas.append(aborted_stream(server, attempt))
        if metas[-1]["finish_reason"]["type"] == "abort":
            break
    assert metas[-1]["finish_reason"]["type"] == "abort", metas
    assert metas[-1]["completion_tokens"] < LONG["max_new_tokens"]


def aborted_pair(server) -> list[str]:
    """Two long requests in flight, ended by `abort_all`; their finish reasons."""
    results = []

    def call() -> None:
        results.append(server.post("/generate", json={"text": PROMPTS[1], "sampling_params": LONG}).json())

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.get("/get_load").json()[0]["num_reqs"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(30)
    return [r["meta_info"]["finish_reason"]["type"] for r in results]


def test_abort_all(server):
    reasons = []
    for _ in range(3):
        reasons.append(aborted_pair(server))
        if reasons[-1] == ["abort", "abort"]:
            break
    assert reasons[-1] == ["abort", "abort"], reasons


def test_information_routes(server):
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert info["is_generation"] is True
        assert info["model_path"]
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path).json()
        assert info["port"] == int(server.url.rsplit(":", 1)[1])
        # One model path for both routes; the settings chosen at start-up are shown as they were chosen.
        assert info["model_path"] == server.get("/get_model_info").json()["model_path"]
        assert (info["span_head_tokens"], info["attention_backend"], info["device"]) == (128, "torch_native", "cpu")
        state = info["internal_states"][0]
        assert state["max_total_num_tokens"] == 4096
        assert {"available_tokens", "evictable_tokens", "token_usage", "num_running_reqs"} <= set(state)
    load = server.get("/get_load").json()
    assert load[0]["num_reqs"] == 0
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    assert server.post("/flush_cache").status_code == 200


def test_metrics(server):
    server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY})
    text = server.get("/metrics").text
    for name in (
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cache_hit_rate",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:shared_decode_steps_total",
    ):
        assert name in text, name
    generated = [l for l in text.splitlines() if l.startswith("sglang:generation_tokens_total")]
    assert float(generated[0].rsplit(" ", 1)[1]) >= 8


def test_profile_routes(server, tmp_path):
    started = server.post("/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"]})
    assert started.status_code == 200 and str(tmp_path) in started.text
    assert "already running" in server.post("/start_profile").text
    server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY})
    stopped = server.post("/stop_profile")
    assert stopped.status_code == 200
    assert [p.name for p in tmp_path.glob("*.trace.json.gz")] and str(tmp_path) in stopped.text
    assert server.post("/stop_profile").status_code == 400
    for body, needle in (
        ({"bogus": 1}, "unknown field: bogus"),
        ({"activities": ["TPU"]}, "activities"),
        ({"profile_by_stage": True}, "unsupported field: profile_by_stage"),
    ):
        refused = server.post("/start_profile", json=body)
        assert refused.status_code == 400 and needle in refused.json()["error"]["message"], refused.text
    assert server.post("/start_profile", data=b"{not json").status_code == 400
    # What `bench_serving --profile` sends: SGLang's other ProfileReqInput fields at their defaults.
    bench_body = {
        "output_dir": str(tmp_path / "bench"), "activities": ["CPU"], "num_steps": None, "profile_by_stage": False,
        "profile_stages": None, "profile_prefix": None,
    }
    assert server.post("/start_profile", json=bench_body).status_code == 200
    server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY})
    assert server.post("/stop_profile").status_code == 200


def test_concurrent_non_streaming_requests(server):
    results: list = [None] * 6

    def call(i: int) -> None:
        body = {"text": PROMPTS[i % 2], "sampling_params": GREEDY}
        results[i] = server.post("/generate", json=body).json()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["meta_info"]["completion_tokens"] == 8 for r in results)
    assert results[0]["output_ids"] == results[2]["output_ids"] == results[4]["output_ids"]


def test_tokenize_and_detokenize(server, engine):
    """/tokenize gives the ids /generate runs and, for a marked prompt, its segments; /detokenize inverts it."""
    tok = engine.tokenizer
    for path in ("/tokenize", "/v1/tokenize"):
        plain = server.post(path, json={"prompt": PROMPTS[0]}).json()
        assert plain["tokens"] == tok.encode(PROMPTS[0]) and plain["count"] == len(plain["tokens"])
        assert plain["segments"] == [{"kind": "prefix", "count": plain["count"]}]
        assert plain["max_model_len"] == engine.model_config.context_len
    doc = "The capital of France is Paris, the capital of Japan is Tokyo."
    marked = "Read this." + span(doc) + "Where is Paris?"
    cut = server.post("/tokenize", json={"prompt": [marked, PROMPTS[1]], "add_special_tokens": False}).json()
    doc_ids = tok.encode(doc, add_special_tokens=False)
    assert [s["kind"] for s in cut["segments"][0]] == ["prefix", "span", "pdep"]
    assert cut["segments"][0][1]["count"] == len(doc_ids)
    assert cut["tokens"][0][cut["segments"][0][0]["count"]:][: len(doc_ids)] == doc_ids
    assert cut["tokens"][1] == tok.encode(PROMPTS[1], add_special_tokens=False)
    with_bos = server.post("/tokenize", json={"prompt": marked}).json()
    ran = server.post("/generate", json={"text": marked, "sampling_params": {"max_new_tokens": 1}}).json()
    assert ran["meta_info"]["prompt_tokens"] == with_bos["count"]

    for path in ("/detokenize", "/v1/detokenize"):
        back = server.post(path, json={"tokens": cut["tokens"][1], "skip_special_tokens": True}).json()
        assert back["text"] == PROMPTS[1]
    both = server.post("/detokenize", json={"tokens": [doc_ids, doc_ids[:3]]}).json()
    assert both["text"] == [doc, tok.decode(doc_ids[:3])]

    bad = [
        ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x" + SSEP_MARKER}, "empty span"),
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
    ]
    for path, body, named in bad:
        reply = server.post(path, json=body)
        assert reply.status_code == 400 and named in reply.json()["error"]["message"], (body, reply.text)


def test_tokenize_takes_generate_text_field(server):
    """/tokenize also takes /generate's `text` for the prompt; giving both names, or neither, is a 400 naming them."""
    by_prompt = server.post("/tokenize", json={"prompt": PROMPTS}).json()
    assert server.post("/tokenize", json={"text": PROMPTS}).json() == by_prompt
    assert server.post("/v1/tokenize", json={"text": PROMPTS[0]}).json()["tokens"] == by_prompt["tokens"][0]
    for body, named in (({"prompt": "x", "text": "x"}, "prompt or text"), ({}, "prompt or messages")):
        reply = server.post("/tokenize", json=body)
        assert reply.status_code == 400 and named in reply.json()["error"]["message"], (body, reply.text)


# What `python -m sglang.bench_serving --backend sglang` (0.5.9) sends besides the prompt, and more of SGLang's
# GenerateReqInput fields at their defaults.
SGLANG_NEUTRAL = {
    "lora_path": None,
    "return_logprob": False,
    "return_routed_experts": False,
    "logprob_start_len": -1,
    "return_hidden_states": False,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "session_params": None,
    "image_data": None,
    "log_metrics": True,
    "top_logprobs_num": None,
}


def test_sglang_fields_at_neutral_values_are_accepted(server):
    plain = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "stream_interval": None}, **SGLANG_NEUTRAL}
    reply = server.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output_ids"] == plain["output_ids"]
    batch = {"text": PROMPTS, "sampling_params": GREEDY, "lora_path": [None, None], "return_hidden_states": [False] * 2}
    assert [o["output_ids"] for o in server.post("/generate", json=batch).json()][0] == plain["output_ids"]


def test_sglang_fields_asking_for_more_are_refused_by_name(server):
    cases = [
        ({"lora_path": "my-adapter"}, ["unsupported field: lora_path", "LoRA"]),
        ({"return_routed_experts": True}, ["unsupported field: return_routed_experts"]),
        ({"lora_path": [None, "my-adapter"]}, ["lora_path"]),
        ({"temprature": 0}, ["unknown field: temprature"]),
        ({"return_hidden_states": True, "session_params": {"id": "s"}, "lora_pth": None},
         ["return_hidden_states", "session_params", "unknown field: lora_pth"]),
        ({"sampling_params": {"stream_interval": 4, "max_tokens": 3}},
         ["unsupported sampling parameter: stream_interval", "unknown sampling parameter: max_tokens"]),
    ]
    for extra, needles in cases:
        reply = server.post("/generate", json={"text": PROMPTS[0], **extra})
        assert reply.status_code == 400, (extra, reply.text)
        message = reply.json()["error"]["message"]
        assert all(n in message for n in needles), (extra, message)


def test_admin_routes_take_sglang_bodies(server):
    abort = {"rid": "no-such-request", "abort_all": False, "finished_reason": None, "abort_message": None}
    assert server.post("/abort_request", json=abort).status_code == 200
    refused = server.post("/abort_request", json={"rid": "x", "abort_message": "bye", "abort_al": True})
    message = refused.json()["error"]["message"]
    assert refused.status_code == 400 and "abort_message" in message and "abort_al" in message
    kept = server.post("/update_weights_from_disk", json={"model_path": "/nowhere", "flush_cache": False})
    assert kept.status_code == 400 and "flush_cache" in kept.json()["message"]
    typo = server.post("/warm_spans", json={"spans": ["a"], "span": ["b"]})
    assert typo.status_code == 400 and "unknown field: span" in typo.json()["error"]["message"]
    too_long = server.post("/warm_spans", json={"spans": ["word " * 2000]})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    assert server.post("/warm_spans", json={"spans": ["a short span"]}).status_code == 200  # still serving


def test_unknown_routes_and_methods_answer_in_each_apis_shape(server):
    """Native paths answer SGLang's {"error": {"message"}}, /v1 paths OpenAI's {"error": {message, type, param,
    code}}, never FastAPI's {"detail": ...}."""
    for method, path, status, needles in (
        ("post", "/no_such_route", 404, ["Not Found", "/no_such_route"]),
        ("get", "/generate", 405, ["Method Not Allowed", "POST"]),
    ):
        reply = getattr(server, method)(path)
        assert reply.status_code == status and set(reply.json()) == {"error"}, reply.text
        assert set(reply.json()["error"]) == {"message"} and all(n in reply.json()["error"]["message"] for n in needles)
    for method, path, status, err_type in (
        ("post", "/v1/no_such_route", 404, "NotFoundError"),
        ("get", "/v1/completions", 405, "MethodNotAllowedError"),
    ):
        reply = getattr(server, method)(path)
        assert reply.status_code == status and set(reply.json()) == {"error"}, reply.text
        err = reply.json()["error"]
        assert err == {"message": err["message"], "type": err_type, "param": None, "code": status}
        assert path in err["message"]


@pytest.mark.slow  # its own server
def test_stream_interval_on_the_server(tiny_llama):
    """The scheduler sends a stream's tokens every --stream-interval tokens (the first at once, then the end); the
    main process may merge updates that arrive together, so each event holds one of those counts."""
    srv = start_server(tiny_llama, "--stream-interval", "8")
    try:
        body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 40}, "stream": True}
        events = sse_events(srv.post("/generate", json=body, stream=True))
        assert events[-1] == "[DONE]"
        counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
        assert counts[-1] == 40 and set(counts) <= {1, 9, 17, 25, 33, 40}, counts
        whole = srv.post("/generate", json={**body, "stream": False}).json()
        assert events[-2]["text"] == whole["text"]
    finally:
        stop_server(srv)
