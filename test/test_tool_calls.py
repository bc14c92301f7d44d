"""Tool calls: parsing each family's call format, streaming around calls, tool descriptions marked as spans."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest
from sglang_pic.entrypoints.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallStream,
    mark_tool_spans,
    tool_call_parser,
)

NAMES = {"get_weather", "add"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'


def as_pairs(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_are_cut_out_of_the_text():
    add = '{"name": "add", "arguments": "{\\"a\\": 1}"}'  # arguments given as JSON text
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{add}\n</tool_call>"
    content, calls = HermesParser().parse(text, NAMES)
    assert content.strip() == "Let me check."
    assert as_pairs(calls) == [("get_weather", {"city": "Paris", "unit": "°C"}), ("add", {"a": 1})]
    assert calls[0].arguments == '{"city": "Paris", "unit": "°C"}'  # the model's own text


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not one of the request's tools
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # arguments must be an object
        "No tools needed: 4.",
    ],
)
def test_hermes_anything_but_a_valid_call_stays_text(text):
    assert HermesParser().parse(text, NAMES) == (text, [])


def test_hermes_accepts_a_last_call_cut_before_its_closing_tag_and_calls_without_tags():
    content, calls = HermesParser().parse(f"<tool_call>\n{WEATHER}", NAMES)
    assert content == "" and as_pairs(calls)[0][0] == "get_weather"
    # Qwen2.5-Coder-0.5B-Instruct answers with the bare object (seen running examples/agent_tools.py)
    content, calls = HermesParser().parse(f" {WEATHER}\n", NAMES)
    assert content == "" and as_pairs(calls) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    prose = f"You could call {WEATHER}"
    assert HermesParser().parse(prose, NAMES) == (prose, [])


def test_llama3_reply_of_json_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {}}'
    content, calls = Llama3JsonParser().parse(text, NAMES)
    assert content == "" and as_pairs(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {})]
    prose = 'The answer is {"a": 1}, as you see.'
    assert Llama3JsonParser().parse(prose, NAMES) == (prose, [])
    half = '{"name": "add", "parameters": {"a": 1}} and then some text'
    assert Llama3JsonParser().parse(half, NAMES) == (half, [])


def test_mistral_calls_follow_their_marker():
    text = 'Checking. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'
    content, calls = MistralParser().parse(text, NAMES)
    assert content == "Checking. " and as_pairs(calls) == [("add", {"a": 1}), ("get_weather", {})]
    for bad in ('[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', '[TOOL_CALLS] [{"name": "add"', "no calls"):
        assert MistralParser().parse(bad, NAMES) == (bad, [])
    sent, rest, calls = stream(MistralParser(), ["Checking. [TOOL", '_CALLS] [{"name": "add", "arguments": {}}]'])
    assert sent == ["Checking. ", ""] and rest == "" and as_pairs(calls) == [("add", {})]


def test_parser_follows_the_flag_then_the_model_family():
    assert isinstance(tool_call_parser(None, "Qwen2ForCausalLM"), HermesParser)
    assert isinstance(tool_call_parser(None, "LlamaForCausalLM"), Llama3JsonParser)
    assert isinstance(tool_call_parser(None, "MistralForCausalLM"), MistralParser)
    assert isinstance(tool_call_parser("qwen25", "LlamaForCausalLM"), HermesParser)
    assert tool_call_parser(None, "GPT2LMHeadModel") is None


def stream(parser, pieces: list[str]) -> tuple[list[str], str, list]:
    """(content sent after each piece, content sent at the end, the calls)."""
    s = ToolCallStream(parser, NAMES)
    sent = [s.feed(p)[0] for p in pieces]
    rest = s.finish()[0]
    return sent, rest, s.whole_calls()


def test_stream_holds_back_what_may_open_a_call_and_never_streams_it():
    pieces = ["Sure", ". <tool", "_call>\n{\"name\": \"add\", ", '"arguments": {"a": 2}}\n</tool_call>']
    sent, rest, calls = stream(HermesParser(), pieces)
    assert sent == ["Sure", ". ", "", ""]  # "<tool" waits until it is known to open a call
    assert rest == "" and as_pairs(calls) == [("add", {"a": 2})]


def test_without_parallel_calls_only_the_first_counts():
    add = '{"name": "add", "arguments": {}}'
    reply = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{add}\n</tool_call>"
    for parallel, names in ((True, ["get_weather", "add"]), (False, ["get_weather"])):
        reader = ToolCallStream(HermesParser(), NAMES, parallel)
        reader.feed(reply)
        reader.finish()
        assert [c.name for c in reader.whole_calls()] == names


def call_deltas(reader: ToolCallStream, pieces: list[str]) -> list[list[tuple]]:
    """The (index, arguments, id, name) of the call deltas after each piece, then after finish."""
    steps = [reader.feed(p)[1] for p in pieces] + [reader.finish()[1]]
    return [[(d.index, d.arguments, d.id, d.name) for d in step] for step in steps]


def test_committed_call_arguments_stream_as_written():
    pieces = [
        "Sure. <tool_call>\n{\"na",
        'me": "add", "argu',
        'ments": {"a": ',
        '2, "b"',
        ': [1, {"c": "}"}]}',
        "}\n</tool_call>",
    ]
    reader = ToolCallStream(HermesParser(), NAMES)
    steps = call_deltas(reader, pieces)
    call_id = reader.ids[0]
    assert call_id.startswith("call_")
    assert steps == [
        [],
        [],  # the header is not whole yet
        [(0, '{"a": ', call_id, "add")],
        [(0, '2, "b"', None, None)],
        [(0, ': [1, {"c": "}"}]}', None, None)],  # a brace inside a string does not close the arguments
        [],
        [],
    ]
    assert [(c.name, c.arguments) for c in reader.whole_calls()] == [("add", '{"a": 2, "b": [1, {"c": "}"}]}')]


ADD = '{"name": "add", "arguments": {"a": 1, "s": "x}{\\"y"}}'
LLAMA3_CALLS = f"{WEATHER}; {ADD}".replace('"arguments"', '"parameters"')
CHUNKED_REPLIES = {
    "qwen25": (
        HermesParser, f"Let me see <b>this</b>.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"
    ),
    "llama3": (Llama3JsonParser, f"<|python_tag|>{LLAMA3_CALLS}"),
    "mistral": (MistralParser, f"Checking. [TOOL_CALLS] [{WEATHER}, {ADD}]"),
}


@pytest.mark.parametrize("family", list(CHUNKED_REPLIES))
def test_any_chunking_adds_up_to_the_whole_reply(family):
    """Content and call deltas from a reply cut at random places add up to what the whole reply gives."""
    parser, reply = CHUNKED_REPLIES[family]
    whole = ToolCallStream(parser(), NAMES)
    expected = whole.feed(reply)[0] + whole.finish()[0], [(c.name, c.arguments) for c in whole.whole_calls()]
    assert expected[1][1] == ("add", '{"a": 1, "s": "x}{\\"y"}')  # the model's text: braces and quotes in a string
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(reply)), rng.randint(1, 12)))
        reader, content, args = ToolCallStream(parser(), NAMES), "", {}
        names = {}
        for a, b in zip([0, *cuts], [*cuts, len(reply)]):
            text, deltas = reader.feed(reply[a:b])
            content += text
            for d in deltas:
                names.setdefault(d.index, d.name)
                args[d.index] = args.get(d.index, "") + d.arguments
        text, deltas = reader.finish()
        content += text
        for d in deltas:
            names.setdefault(d.index, d.name)
            args[d.index] = args.get(d.index, "") + d.arguments
        assert (content, [(names[i], args[i]) for i in sorted(args)]) == expected, cuts


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_calls_where_the_format_puts_them_stream_as_written(family):
    parser, reply = CHUNKED_REPLIES[family]
    cut = reply.index('"x}')  # inside the second call's arguments
    steps = call_deltas(ToolCallStream(parser(), NAMES), [reply[:cut], reply[cut:]])
    assert [(i, a, n) for i, a, _, n in steps[0]] == [
        (0, '{"city": "Paris", "unit": "°C"}', "get_weather"), (1, '{"a": 1, "s": ', "add")
    ]
    assert [(i, a) for i, a, _, _ in steps[1]] == [(1, '"x}{\\"y"}')] and steps[2] == []


def test_calls_only_the_end_can_confirm_go_out_whole():
    pieces = ['{"name": "add", "arguments": {"a":', ' 1}}']
    steps = call_deltas(ToolCallStream(HermesParser(), NAMES), pieces)
    assert steps[:2] == [[], []] and [(i, a, n) for i, a, _, n in steps[2]] == [(0, '{"a": 1}', "add")]
    forced = ToolCallStream(HermesParser(), NAMES, forced=True)  # tool_choice made the reply a call
    steps = call_deltas(forced, pieces)
    assert [[(a, n) for _, a, _, n in step] for step in steps] == [[("{\"a\":", "add")], [(" 1}", None)], []]
    unknown = '<tool_call>\n{"name": "launch", "arguments": {"x": 1}}\n</tool_call>'
    assert call_deltas(ToolCallStream(HermesParser(), NAMES), [unknown]) == [[], []]


def test_stream_releases_held_text_that_was_not_a_call():
    pieces = ["a < b", " and <tool", "s> are fine"]
    sent, rest, calls = stream(HermesParser(), pieces)
    assert "".join(sent) + rest == "a < b and <tools> are fine" and calls == []
    assert sent[1] == " and "  # "<tool" held back, then released once it cannot open a call
    sent, rest, calls = stream(Llama3JsonParser(), ['{"x": 1} is a', " dict"])
    assert sent == ["", ""] and rest == '{"x": 1} is a dict' and calls == []
    sent, rest, calls = stream(HermesParser(), ["{\"name\": \"add\", ", '"arguments": {}}'])
    assert sent == ["", ""] and rest == "" and as_pairs(calls) == [("add", {})]


def test_each_tool_rendering_becomes_a_span():
    tools = [{"type": "function", "function": {"name": n, "description": f"{n} tool"}} for n in ("a", "b")]
    rendered = [json.dumps(t) for t in tools]
    prompt = f"<tools>\n{rendered[0]}\n{rendered[1]}\n</tools>\nQ"
    marked = mark_tool_spans(prompt, tools, "<S>", "<P>")
    assert marked == f"<tools>\n<S>{rendered[0]}<P>\n<S>{rendered[1]}<P>\n</tools>\nQ"
    indented = "<tools>" + "".join(json.dumps(t, indent=4) for t in tools) + "</tools>"  # adjacent: no PDEP between
    assert mark_tool_spans(indented, tools, "<S>", "<P>").count("<P>") == 1
    with pytest.raises(ValueError, match="tool_spans"):
        mark_tool_spans("a template that renders tools its own way", tools, "<S>", "<P>")


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def test_request_validation_of_tools():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    assert chat(tools=[tool]).uses_tools() and not chat(tools=[tool], tool_choice="none").uses_tools()
    assert chat(tools=[tool]).forced_tools() is None
    assert [t.function.name for t in chat(tools=[tool], tool_choice="required").forced_tools()] == ["add"]
    named = {"type": "function", "function": {"name": "add"}}
    assert [t.function.name for t in chat(tools=[tool], tool_choice=named).forced_tools()] == ["add"]
    with pytest.raises(ValueError, match="not among the tools"):
        chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "sub"}}).forced_tools()
    with pytest.raises(ValueError, match="needs tools"):
        chat(tool_choice="required").forced_tools()
    with pytest.raises(ValidationError, match="distinct"):
        chat(tools=[tool, tool])
    with pytest.raises(ValidationError):
        chat(tools=[{"type": "function", "function": {"description": "no name"}}])


def test_unknown_tool_call_parser_is_refused(tiny_llama):
    from sglang_pic.server_args import ServerArgs

    with pytest.raises(ValueError, match="tool_call_parser must be one of qwen25, llama3, mistral"):
        ServerArgs(model_path=str(tiny_llama), tool_call_parser="hermes2")


@pytest.mark.parametrize("fence", ["```json\n{call}\n```", "```\n{call}\n```\n", "```json\n{call}"])
def test_a_reply_of_one_fenced_call_is_a_call(fence):
    """Qwen2.5-Coder-0.5B-Instruct wraps its call in a Markdown code block on most turns of the agent benchmark;
    the block is held back while streaming and goes out as the call."""
    text = fence.format(call=WEATHER)
    assert as_pairs(HermesParser().parse(text, NAMES)[1]) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    sent, rest, calls = stream(HermesParser(), [text[:5], text[5:]])
    assert sent == ["", ""] and rest == "" and len(calls) == 1
    code = "```python\nprint(1)\n```"  # a fenced reply that is no call stays text
    assert HermesParser().parse(code, NAMES) == (code, [])
    sent, rest, calls = stream(HermesParser(), [code[:4], code[4:]])
    assert "".join(sent) + rest == code and calls == []


@pytest.mark.parametrize("special", [False, True])
def test_replies_keep_special_tokens_only_when_a_call_tag_is_one(tiny_qwen2, special):
    """Qwen's <tool_call> is an ordinary added token, so a reply is decoded without special tokens (a stray
    <|im_start|> from a small model stays out of the text and the call still parses); a tag that is a special token
    (Llama 3's <|python_tag|>) needs them kept."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    tags = ["<tool_call>", "</tool_call>"]
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": tags})
    else:
        tokenizer.add_tokens(tags)
    assert tool_call_parser("qwen25", "Qwen2ForCausalLM").tags_are_special(tokenizer) is special
