"""Lexically selected recompute: a request recomputes whole the spans that share the question's rarest words.

Under span attention the answer is lost mostly in the asked document's own context-free KV: recomputing that one
span in context answers as dense attention does (benchmark/study_query_selection.py --oracle), and a document that
a question asks about usually names what the question names. So a request with spans that have a query share and
select by `lexical` needs no pass: when it is built, each such span is scored by the words it shares with the
question, the last line after the last span that says a word some spans say and others do not (a conversation's
latest question, not its earlier turns), each word counting log(spans / spans saying it): a word of every span (a
shared template's) counts nothing, a name only one span says counts most. Spans are taken whole, best first (the
earlier on ties), while the tokens taken are short of the share of those spans' tokens, so the best span is taken
whatever the share; a span that shares no such word is never taken.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence, Set
from dataclasses import replace
from functools import lru_cache

from sglang_pic.radix_ext.segments import Segment

WORD = re.compile(r"[^\W_]+")


def words(text: str) -> set[str]:
    return set(WORD.findall(text.lower()))


def selects_lexically(seg: Segment) -> bool:
    return seg.kind == "span" and seg.query_share > 0 and seg.select == "lexical"


def question_weights(spans: Sequence[Set[str]], after: str) -> dict[str, float]:
    """The rare words of the question line of `after` (the text after the last span), with their weights."""
    for line in reversed(after.splitlines()):
        weights = {}
        for word in words(line):
            holding = sum(word in span for span in spans)
            if 0 < holding < len(spans):
                weights[word] = math.log(len(spans) / holding)
        if weights:
            return weights
    return {}


def lexical_scores(spans: Sequence[Set[str]], after: str) -> list[float]:
    """Each span's score: the weights of the question line's rare words it says."""
    weights = question_weights(spans, after)
    return [sum(weights.get(word, 0.0) for word in span) for span in spans]


class SpanWords:
    """Each span's word set by its token ids, kept for the spans seen last: spans recur, so most are decoded once
    (building 600 ten-passage RAG requests took 366 ms more with lexical selection than without, 175 ms kept)."""

    def __init__(self, decode: Callable[[list[int]], str], size: int = 4096) -> None:
        self.decode = decode
        self.words = lru_cache(maxsize=size)(self._words)

    def _words(self, token_ids: tuple[int, ...]) -> frozenset[str]:
        return frozenset(words(self.decode(list(token_ids))))


def choose_lexical(segments: list[Segment], span_words: SpanWords) -> list[Segment]:
    """`segments` with the chosen lexical spans recomputed whole and every lexical span's query share spent (0)."""
    lexical = [i for i, seg in enumerate(segments) if selects_lexically(seg)]
    if not lexical:
        return segments
    last = max(i for i, seg in enumerate(segments) if seg.kind == "span")
    after = span_words.decode([t for seg in segments[last + 1:] for t in seg.token_ids])
    spans = [span_words.words(tuple(segments[i].token_ids)) for i in lexical]
    scores = lexical_scores(spans, after)
    budget = sum(segments[i].query_share * len(segments[i].token_ids) for i in lexical)
    out, taken = list(segments), 0
    for k in sorted(range(len(lexical)), key=lambda k: (-scores[k], k)):
        if scores[k] <= 0 or taken >= budget:
            break
        seg = segments[lexical[k]]
        out[lexical[k]] = replace(seg, recompute=((0, len(seg.token_ids)),))
        taken += len(seg.token_ids)
    for i in lexical:
        out[i] = replace(out[i], query_share=0.0)
    return out
