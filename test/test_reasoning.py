"""Reasoning split from the answer: <think> sections parsed whole or streamed in any pieces, templates that open
the thinking in the prompt, tool calls read from the answer only, and the server's reasoning_content."""

from __future__ import annotations

import json

import pytest
from server_utils import start_server, stop_server

from sglang_pic.entrypoints.chat_reply import ChatReplyReader
from sglang_pic.entrypoints.reasoning import REASONING_PARSERS, ReasoningStream
from sglang_pic.entrypoints.tool_calls import HermesParser, ToolCallStream
from sglang_pic.server_args import ServerArgs

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek-r1"]


def split(fmt, text: str, cuts: list[int], prompt: str = "") -> tuple[list[tuple[str, str]], str, str]:
    """Stream a reply to `prompt`, cut at `cuts`: (what each piece passed on, all reasoning, all content)."""
    stream = ReasoningStream(fmt, prompt)
    bounds = [0, *cuts, len(text)]
    steps = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    return steps, "".join(r for r, _ in steps), "".join(c for _, c in steps)


REPLY = "<think>\nThe user wants a number. </th is not a tag.\n</think>\n\nFour."


@pytest.mark.parametrize("cuts", [[], [3], [7, 20, 47, 52], list(range(1, len(REPLY)))])
def test_thinking_and_answer_split_the_same_in_any_pieces(cuts):
    _, reasoning, content = split(QWEN3, REPLY, cuts)
    assert reasoning == "The user wants a number. </th is not a tag.\n"
    assert content == "Four."


def test_tags_cut_between_pieces_are_held_back():
    steps, _, _ = split(QWEN3, REPLY, [3, 47, 52])
    assert steps[0] == ("", "")  # "<th" may open the thinking
    assert steps[2][0].endswith("tag.\n") and steps[2][1] == ""  # "</thi" held, then known to close it
    plain, reasoning, content = split(QWEN3, "<b>bold</b> text", [1])
    assert plain[0] == ("", "") and (reasoning, content) == ("", "<b>bold</b> text")


def test_a_template_that_opens_the_thinking():
    reply = "Counting: 2 + 2.</think>Four."
    assert split(R1, reply, [10])[1:] == ("Counting: 2 + 2.", "Four.")  # deepseek-r1 always starts inside
    assert split(QWEN3, reply, [10], prompt="<|im_start|>assistant\n<think>\n")[1:] == ("Counting: 2 + 2.", "Four.")
    assert split(QWEN3, reply, [10])[1:] == ("", reply)  # no opening tag: no reasoning
    assert split(R1, "Cut short while thinking", [4])[1:] == ("Cut short while thinking", "")


def test_tool_calls_come_from_the_answer_only():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    reply = f"<think>I could write {call} here.</think>Let me add.\n{call}"
    reader = ChatReplyReader(ReasoningStream(QWEN3, ""), ToolCallStream(HermesParser(), {"add"}))
    pieces = [reader.read(reply[i : i + 9], last=i + 9 >= len(reply)) for i in range(0, len(reply), 9)]
    assert "".join(p.reasoning for p in pieces) == f"I could write {call} here."
    assert "".join(p.content for p in pieces).strip() == "Let me add."
    assert [(c.name, c.arguments) for c in reader.tools.whole_calls()] == [("add", '{"a": 1}')]


def test_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek-r1, qwen3"):
        ServerArgs(model_path="m", reasoning_parser="o1")


# A chatml template that opens the thinking for the reply, as thinking-only models' templates do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    template = tmp_path_factory.mktemp("thinking") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    srv = start_server(tiny_qwen2, "--chat-template", str(template), "--reasoning-parser", "qwen3")
    yield srv
    stop_server(srv)


def chat(server, **fields):
    body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **fields}
    return server.post("/v1/chat/completions", json=body)


def test_server_puts_the_thinking_in_reasoning_content(server):
    """The tiny model never closes its thinking, which the template opened: its whole reply is reasoning."""
    raw = chat(server, separate_reasoning=False).json()["choices"][0]["message"]
    assert raw["reasoning_content"] is None and raw["content"]
    split_reply = chat(server).json()["choices"][0]["message"]
    assert split_reply["content"] is None
    assert split_reply["reasoning_content"] == raw["content"].lstrip()

    lines = chat(server, stream=True).text.splitlines()
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == split_reply["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
