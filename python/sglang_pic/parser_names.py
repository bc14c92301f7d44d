"""The names `--reasoning-parser` and `--tool-call-parser` accept.

They sit at the bottom so that ServerArgs checks a flag without importing the chat layer, and that layer's parser
registries are keyed by these members, so a flag value and a registry entry cannot name different things.
"""

from __future__ import annotations

from enum import StrEnum


class ReasoningParserName(StrEnum):
    DEEPSEEK_R1 = "deepseek-r1"
    QWEN3 = "qwen3"
    QWEN3_THINKING = "qwen3-thinking"


class ToolCallParserName(StrEnum):
    QWEN25 = "qwen25"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


# As plain tuples: `in` tests a str against them (an enum class refuses non-members before Python 3.12).
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(ReasoningParserName)
TOOL_CALL_PARSER_NAMES: tuple[str, ...] = tuple(ToolCallParserName)
