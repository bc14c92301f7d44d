"""A bounded LRU memo of segment text -> token ids, so a span that recurs is tokenized once.

The segmenter tokenizes every segment on its own, so a segment's ids depend only on its text and on whether it is
the prefix (only the prefix gets BOS): a hit returns exactly what encoding would, never another text's ids.
Tokenizing is the host cost of the cached-span path that grows with span length (1.2-1.4 ms per 1K tokens on one
CPU core with the Qwen2.5 tokenizer, see benchmark/bench_span_host.py); a hit costs hashing the text once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_MAX_TOKENS = 1 << 20  # ids held in all; ~40 MB as Python ints, e.g. 32 spans of 32K or 1,000 of 1K tokens
MIN_CACHED_CHARS = 256  # shorter text encodes in under 0.1 ms; skipping it also bounds the number of entries


class SegmentTokenCache:
    """`cache(text, first)` = `encode(text, first)`, remembered for the most recently used texts.

    Thread-safe: the offline Engine tokenizes on its callers' threads. Encoding runs outside the lock, so two
    threads missing on the same text both encode it and store equal ids.
    """

    def __init__(
        self,
        encode: Callable[[str, bool], tuple[int, ...]],
        max_tokens: int = DEFAULT_MAX_TOKENS,
        min_chars: int = MIN_CACHED_CHARS,
    ) -> None:
        self._encode = encode
        self.max_tokens = max_tokens
        self.min_chars = min_chars
        self._entries: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Token ids held right now (at most `max_tokens`)."""
        return self._num_tokens

    def __call__(self, text: str, first: bool) -> tuple[int, ...]:
        ids = self.get(text, first)
        if ids is not None:
            return ids
        return self.put(text, first, self._encode(text, first))

    def get(self, text: str, first: bool) -> tuple[int, ...] | None:
        """The remembered ids of `text`, or None (short texts are never remembered)."""
        if len(text) < self.min_chars:
            return None
        key = (text, first)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
            return ids

    def put(self, text: str, first: bool, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Remember `ids` as the encoding of `text` if it is long enough and fits; returns `ids`."""
        if len(text) >= self.min_chars and len(ids) <= self.max_tokens:
            self._store((text, first), ids)
        return ids

    def _store(self, key: tuple[str, bool], ids: tuple[int, ...]) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old)
            self._entries[key] = ids
            self._num_tokens += len(ids)
            while self._num_tokens > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self._num_tokens -= len(evicted)
