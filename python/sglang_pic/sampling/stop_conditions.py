"""Stop strings and stop regexes, found in the decoded output.

After each output token the scheduler searches the text of the newest tokens (enough to hold the longest stop) for
the earliest stop; a find ends the request and records how many trailing characters to cut, so the final text ends
where the stop began. While a request streams, the tail that could still grow into a stop is held back, so every
streamed text is a prefix of the final one.

Patterns run on the `regex` engine (Python `re` syntax) for its partial matching and its timeout: a pattern that
backtracks catastrophically would otherwise stall the scheduler and every request in it. A search that runs out of
time raises TimeoutError, and the scheduler aborts that request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import regex

# A pattern that can match more characters than this is checked against the whole output, not a window.
MAX_WINDOW_CHARS = 4096
# The longest one stop_regex search may take (seconds).
SEARCH_TIMEOUT_S = 0.05


class StopTokenizer(Protocol):
    """Anything with an HF-style `encode`; a `tokenizers.Tokenizer` (returning an Encoding) also fits."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string or pattern, reported as finish_reason.matched
    start: int  # where the match starts in the searched text


def partial_prefix(text: str, word: str) -> int:
    """How many trailing characters of `text` begin `word` without completing it (0 if none): what a stream holds
    back while `word` may still be forming."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0


def check_stop_regex(pattern: str) -> None:
    """Refuse a stop_regex that is not a pattern or can stop on nothing."""
    try:
        fewest = _width(pattern)[0]
        regex.compile(pattern)
    except (re.error, regex.error) as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    if fewest == 0:
        raise ValueError(f"stop_regex {pattern!r} can match an empty string, which would stop at once")


def _width(pattern: str) -> tuple[int, int]:
    """(fewest, most) characters a match of `pattern` spans, from Python's own regex parser."""
    return re._parser.parse(pattern).getwidth()


def _pattern_chars(pattern: str) -> int | None:
    """The most characters a match spans; None where that is unbounded or too many to window."""
    most = _width(pattern)[1]
    return most if most <= MAX_WINDOW_CHARS else None


@dataclass
class StopConditions:
    strings: list[str]
    patterns: list[str]
    # Output tokens whose text holds any stop that the newest token can complete; None: the whole output.
    window: int | None
    _compiled: list[Any] = field(init=False, repr=False)
    _chars: list[int | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._compiled = [regex.compile(p) for p in self.patterns]
        self._chars = [_pattern_chars(p) for p in self.patterns]

    @classmethod
    def build(cls, strings: list[str], patterns: list[str], tokenizer: StopTokenizer | None) -> StopConditions | None:
        """None when there is nothing to look for. A token holds at least one character, so a pattern's longest
        match in characters bounds it in tokens; the window has one token more, whose text is left context only."""
        if not strings and not patterns:
            return None
        sizes = [_tokens(s, tokenizer) for s in strings] + [_pattern_chars(p) for p in patterns]
        return cls(list(strings), list(patterns), None if None in sizes else max(sizes) + 1)

    def search(self, text: str, pos: int = 0) -> StopMatch | None:
        """The earliest stop starting in text[pos:]; on a tie the first listed wins. `pos` > 0 keeps `^` and
        lookbehinds from taking the window's first character for the output's start. Raises TimeoutError when a
        pattern takes longer than SEARCH_TIMEOUT_S."""
        best: StopMatch | None = None
        for s in self.strings:
            at = text.find(s, pos)
            if at >= 0 and (best is None or at < best.start):
                best = StopMatch(s, at)
        for source, compiled in zip(self.patterns, self._compiled):
            m = compiled.search(text, pos, timeout=SEARCH_TIMEOUT_S)
            if m is not None and (best is None or m.start() < best.start):
                best = StopMatch(source, m.start())
        return best

    def hold_back(self, text: str) -> int:
        """How many trailing characters of `text` could still become the start of a stop (a pattern that runs out of
        time holds nothing back: the scheduler's search of the same text aborts the request)."""
        held = max((partial_prefix(text, s) for s in self.strings), default=0)
        for compiled, chars in zip(self._compiled, self._chars):
            pos = 0 if chars is None else max(0, len(text) - chars)
            while pos <= len(text):
                try:
                    m = compiled.search(text, pos, partial=True, timeout=SEARCH_TIMEOUT_S)
                except TimeoutError:
                    break
                if m is None:
                    break
                if m.partial:
                    held = max(held, len(text) - m.start())
                    break
                pos = m.end() if m.end() > m.start() else m.end() + 1  # a whole match the scheduler let pass
        return held


def _tokens(stop: str, tokenizer: StopTokenizer | None) -> int:
    if tokenizer is None:
        return len(stop)  # a token holds at least one character, so this bounds the token count
    encoded = tokenizer.encode(stop, add_special_tokens=False)
    return len(getattr(encoded, "ids", encoded))
