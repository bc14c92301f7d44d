"""Tools in /v1/chat/completions on a live server: shown to the model through the chat template, earlier calls and
their results rendered, forced calls constrained to the tools' schemas, JSON response formats, and tool descriptions
reused as spans in any order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from server_utils import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_agent_tools import HERMES_TEMPLATE  # noqa: E402

def tool(name: str, description: str) -> dict:
    params = {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = [
    tool("search_docs", "Search the engineering handbook for pages about a topic and return the best matching titles."),
    tool("get_weather", "Look up the current weather and the forecast for the next three days in a given city."),
    tool("run_sql", "Run a read-only SQL query against the analytics warehouse and return at most fifty rows."),
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_and_template(tmp_path_factory):
    from tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tools")
    model = build_tiny_model(root, "qwen2", max_position_embeddings=2048)  # tool JSON is long in the tiny vocab
    template = root / "tools.jinja"
    template.write_text(HERMES_TEMPLATE)  # one JSON line per tool, calls in <tool_call> tags (Qwen2.5's layout)
    return model, template


@pytest.fixture(scope="module")
def server(model_and_template):
    model, template = model_and_template
    srv = start_server(model, "--chat-template", str(template))
    yield srv
    stop_server(srv)


def chat(server, **body):
    request = {"messages": USER, "max_tokens": 4, "temperature": 0, **body}
    return server.post("/v1/chat/completions", json=request)


def test_tools_reach_the_model_unless_tool_choice_is_none(server):
    plain = chat(server).json()["usage"]["prompt_tokens"]
    reply = chat(server, tools=TOOLS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["prompt_tokens"] > plain + 60
    assert body["choices"][0]["finish_reason"] in ("stop", "length")  # the tiny model calls nothing
    assert body["choices"][0]["message"]["tool_calls"] is None
    assert chat(server, tools=TOOLS, tool_choice="none").json()["usage"]["prompt_tokens"] == plain


def test_earlier_calls_and_their_results_are_rendered(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"query": "Paris"}'}}
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
    ]
    short = chat(server, tools=TOOLS).json()["usage"]["prompt_tokens"]
    reply = chat(server, tools=TOOLS, messages=history)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > short + 10


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
FORECAST = [tool("get_weather", "Current weather in a city."), tool("get_forecast", "Forecast for a city.")]
for t in FORECAST:
    t["function"]["parameters"] = CITY


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_follow_the_tool_schema(server, stream):
    """tool_choice 'required' or a named function constrains the reply to one call (a grammar from the tools'
    parameter schemas), which comes back as a tool call even from a model that never learnt to call tools."""
    for choice, names in (("required", {"get_weather", "get_forecast"}), (
            {"type": "function", "function": {"name": "get_forecast"}}, {"get_forecast"})):
        reply = chat(server, tools=FORECAST, tool_choice=choice, max_tokens=64, stream=stream)
        assert reply.status_code == 200, reply.text
        if stream:
            chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
            deltas = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls") or []]
            finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]]
            # a forced call streams its arguments as they are written; only the first delta names the call
            assert len(deltas) > 2 and {d["index"] for d in deltas} == {0}
            assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
            arguments = "".join(d["function"]["arguments"] for d in deltas)
            name = deltas[0]["function"]["name"]
            calls = [{"id": deltas[0]["id"], "function": {"name": name, "arguments": arguments}}]
        else:
            choice_out = reply.json()["choices"][0]
            calls, finish = choice_out["message"]["tool_calls"], [choice_out["finish_reason"]]
        assert finish == ["tool_calls"] and len(calls) == 1
        assert calls[0]["function"]["name"] in names
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Oslo")


def test_bad_tool_requests_are_refused_with_the_reason(server):
    unknown = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert unknown.status_code == 400 and "not among the tools" in unknown.json()["error"]["message"]
    bad = chat(server, tools=[{"type": "function", "function": {"description": "nameless"}}])
    assert bad.status_code == 400 and "name" in bad.json()["error"]["message"]
    both = chat(server, tools=FORECAST, tool_choice="required", response_format={"type": "json_object"})
    assert both.status_code == 400 and "only one output constraint" in both.json()["error"]["message"]


def test_response_format_json_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    reply = chat(server, response_format=fmt, max_tokens=64)
    assert reply.status_code == 200, reply.text
    assert json.loads(reply.json()["choices"][0]["message"]["content"])["city"] in ("Paris", "Oslo")


def test_streamed_content_with_tools_equals_the_reply(server):
    whole = chat(server, tools=TOOLS, max_tokens=12).json()["choices"][0]["message"]["content"]
    lines = chat(server, tools=TOOLS, max_tokens=12, stream=True).text.splitlines()
    chunks = [line.removeprefix("data: ") for line in lines if line.startswith("data: {")]
    deltas = [json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert "".join(deltas) == (whole or "")


def test_tool_spans_reuse_each_description_in_any_order(server):
    """As spans, descriptions cached by one request are reused by a later one that lists them in another order;
    as plain prompt text only the common prefix before the first tool is."""

    def cached(tools: list[dict], spans: bool) -> int:
        reply = chat(server, tools=tools, tool_spans=spans)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(TOOLS, True)
    cached(TOOLS, False)
    as_spans = cached([TOOLS[2], TOOLS[0]], True)
    as_text = cached([TOOLS[2], TOOLS[1]], False)
    assert as_spans > as_text + 60


def test_server_tool_spans_serve_unchanged_clients(model_and_template):
    """With --tool-spans on, an OpenAI client that sends no extra field gets its tools as spans: a reordered or
    smaller tool list reuses the cached descriptions (usage's cached_tokens); a request's own tool_spans wins."""
    import openai

    model, template = model_and_template
    srv = start_server(model, "--chat-template", str(template), "--tool-spans", "on")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")

        def cached(tools: list[dict]) -> int:
            reply = client.chat.completions.create(
                model="default", messages=USER, tools=tools, max_tokens=2, temperature=0
            )
            return reply.usage.prompt_tokens_details.cached_tokens

        cached(TOOLS)
        reordered, subset = cached([TOOLS[2], TOOLS[1], TOOLS[0]]), cached([TOOLS[2], TOOLS[0]])
        assert reordered > 200 and subset > 200  # as text, only the ~15 tokens before the first tool
        counted = srv.post("/v1/tokenize", json={"messages": USER, "tools": TOOLS}).json()
        assert [s["kind"] for s in counted["segments"]] == ["prefix", "span", "span", "span", "pdep"]
        own = srv.post("/v1/tokenize", json={"messages": USER, "tools": TOOLS, "tool_spans": False}).json()
        assert [s["kind"] for s in own["segments"]] == ["prefix"]
    finally:
        stop_server(srv)


def test_tool_spans_flag_takes_on_or_off(tmp_path):
    from sglang_pic.server_args import ServerArgs

    with pytest.raises(ValueError, match="tool_spans must be on or off"):
        ServerArgs(model_path=str(tmp_path), tool_spans="yes")


def test_tool_spans_take_their_own_settings(server):
    """`tool_spans` as an object gives the description spans their own settings; bad ones are named."""
    own = {"span_anchor": "none", "span_head_tokens": 0}
    first = chat(server, tools=TOOLS, tool_spans=own)
    assert first.status_code == 200, first.text
    again = chat(server, tools=[TOOLS[1], TOOLS[0]], tool_spans=own)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 60
    counted = server.post("/v1/tokenize", json={"messages": USER, "tools": TOOLS, "tool_spans": own}).json()
    assert [s["kind"] for s in counted["segments"]] == ["prefix", "span", "span", "span", "pdep"]
    for bad, named in (({"span_head_tokens": -1}, "span_head_tokens must be"), ({"head": 1}, "head")):
        reply = chat(server, tools=TOOLS, tool_spans=bad)
        assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text


def test_openai_client_assembles_streamed_call_deltas(server):
    """The official client's stream helper adds the argument deltas up to the call the unstreamed reply holds."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kwargs = {"model": "default", "messages": USER, "tools": FORECAST, "tool_choice": "required", "max_tokens": 64,
              "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert streamed[0].id.startswith("call_")


def test_tokenize_chat_messages_counts_what_the_chat_route_runs(server):
    """/tokenize with messages (and tools, as spans or not) reports the prompt a chat completion runs."""
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_spans": True}):
        ran = chat(server, **extra).json()["usage"]["prompt_tokens"]
        counted = server.post("/v1/tokenize", json={"messages": USER, **extra}).json()
        assert counted["count"] == ran, extra
        kinds = [s["kind"] for s in counted["segments"]]
        assert kinds == (["prefix", "span", "span", "span", "pdep"] if extra.get("tool_spans") else ["prefix"])
    both = server.post("/tokenize", json={"messages": USER, "prompt": "hi"})
    assert both.status_code == 400 and "either prompt or messages" in both.json()["error"]["message"]
