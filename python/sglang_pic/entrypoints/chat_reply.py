"""One chat choice's reply read as it streams (or whole): the reasoning split off first, then tool calls read from
what remains, so a call written while thinking is never taken for one."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_pic.entrypoints.reasoning import ReasoningStream
from sglang_pic.entrypoints.tool_calls import CallDelta, ToolCallStream


@dataclass
class ReplyPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ChatReplyReader:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def read(self, delta: str, last: bool = False) -> ReplyPiece:
        """What of the reply's next text `delta` can be passed on now; with `last`, everything left too."""
        reasoning, content = self.reasoning.feed(delta) if self.reasoning is not None else ("", delta)
        if last and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        piece = ReplyPiece(reasoning, content)
        if self.tools is not None:
            piece.content, piece.calls = self.tools.feed(content)
            if last:
                rest, calls = self.tools.finish()
                piece.content, piece.calls = piece.content + rest, piece.calls + calls
        return piece

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)
