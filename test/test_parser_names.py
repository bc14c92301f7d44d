"""The names --reasoning-parser and --tool-call-parser accept (parser_names.py) are exactly the chat layer's parsers."""

from __future__ import annotations

from sglang_pic.entrypoints.reasoning import REASONING_PARSERS
from sglang_pic.entrypoints.tool_calls import ARCHITECTURE_PARSERS, TOOL_CALL_PARSERS
from sglang_pic.parser_names import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES


def test_every_flag_value_names_a_parser_and_every_parser_a_flag_value() -> None:
    assert sorted(REASONING_PARSERS) == sorted(REASONING_PARSER_NAMES)
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_CALL_PARSER_NAMES)
    assert set(ARCHITECTURE_PARSERS.values()) <= set(TOOL_CALL_PARSER_NAMES)
