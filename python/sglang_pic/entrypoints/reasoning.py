"""A reasoning model's thinking split from its answer in chat completions (`--reasoning-parser`).

Thinking models write their reasoning between <think> and </think> before the answer. With a parser the reply's
reasoning goes to `reasoning_content` and the rest to `content` (tool calls are then read from the content only).
A reply that starts without the opening tag has no reasoning, unless the chat template opened it in the prompt
(DeepSeek-R1 and Qwen3 thinking-only models do): then everything up to </think> is reasoning. Streamed, each delta
carries the new reasoning or the new content, and a tag cut at a chunk's end is held back until it is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_pic.parser_names import ReasoningParserName
from sglang_pic.sampling.stop_conditions import partial_prefix


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    opens_in_template: bool = False  # the model's templates always open the thinking in the prompt

    def opened_by(self, prompt: str) -> bool:
        """Whether a reply to `prompt` starts inside the thinking."""
        return self.opens_in_template or prompt.rstrip().endswith(self.start)


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    ReasoningParserName.DEEPSEEK_R1: ReasoningFormat(opens_in_template=True),
    ReasoningParserName.QWEN3: ReasoningFormat(),
    ReasoningParserName.QWEN3_THINKING: ReasoningFormat(opens_in_template=True),
}


class ReasoningStream:
    """Splits a reply, streamed or whole, into reasoning and content. Both are kept as prefixes of what the whole
    reply gives: leading whitespace of each is dropped (it waits until something else follows)."""

    def __init__(self, fmt: ReasoningFormat, prompt_end: str) -> None:
        """`prompt_end`: the prompt's last text, enough to see whether the template opened the thinking."""
        self.fmt = fmt
        self.opened = fmt.opened_by(prompt_end)
        self.text = ""
        self.reasoning = ""  # sent so far
        self.content = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(new reasoning, new content) that can be passed on now."""
        self.text += delta
        return self._advance(*self._split(final=False))

    def finish(self) -> tuple[str, str]:
        """What is left once the reply has ended: held-back partial tags are text after all."""
        return self._advance(*self._split(final=True))

    def _split(self, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far, without what may still turn into a tag."""
        text, fmt = self.text, self.fmt
        start = 0
        if not self.opened:
            head = text.lstrip()
            if not head.startswith(fmt.start):
                undecided = not final and fmt.start.startswith(head)
                return "", "" if undecided else text.lstrip()
            start = len(text) - len(head) + len(fmt.start)
        end = text.find(fmt.end, start)
        if end < 0:
            stop = len(text) if final else len(text) - partial_prefix(text, fmt.end)
            return text[start:stop].lstrip(), ""
        return text[start:end].lstrip(), text[end + len(fmt.end) :].lstrip()

    def _advance(self, reasoning: str, content: str) -> tuple[str, str]:
        new = reasoning[len(self.reasoning) :], content[len(self.content) :]
        self.reasoning, self.content = reasoning, content
        return new
