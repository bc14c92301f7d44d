"""SGLang's parallel encoding: `fork`, one statement per fork, `join(mode="concate_and_append")`.

SGLang's client commits the shared prefix P and then each fork's text P + S_i as prompts that generate nothing,
posts `/concate_and_append_request` with the forks' ids, and later sends the destination's whole text
P + S_0 + ... + S_k-1 + rest as a plain prompt. Its ids never reach the server with a prompt, so the join is
matched by text: the destination's prompt is P, then exactly k statements that were committed behind P, then
the rest. Such a prompt is served as P, each statement a span anchored on P (span_anchor "prefix": its KV is the
plain text P + S_i, which the fork's commit already computed), then the rest, which attends to everything. The
statements see the prefix and themselves, not each other (SGLang's semantics for the join), except for the head
tokens the request's span settings recompute: with the default head a statement shorter than it is recomputed
whole, since on an ordinary model statements encoded apart mix their facts (benchmark/bench_parallel_encoding.py).

A join that no prompt matches within JOIN_TTL_S is dropped; commits are remembered up to MAX_COMMITS. A plain
prompt from another client that happens to have this exact shape while a join is pending is served the same way.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import format_settings

JOIN_TTL_S = 600.0
MAX_COMMITS = 1024
MAX_JOINS = 256


class ParallelEncoding:
    def __init__(self, server_args: ServerArgs) -> None:
        args = server_args
        self.markers = (args.ssep_marker, args.pdep_marker, args.span_settings_marker)
        prefix_anchor = format_settings({"span_anchor": "prefix"})
        self.statement_open = args.ssep_marker + args.span_settings_marker + prefix_anchor
        self.close = args.pdep_marker
        self.commits: OrderedDict[str, None] = OrderedDict()  # recent prompts that generated nothing, oldest first
        self.joins: deque[tuple[float, int]] = deque(maxlen=MAX_JOINS)  # (when, number of statements)

    def expect_join(self, src_rids: list[str]) -> None:
        if not isinstance(src_rids, list) or not src_rids or not all(isinstance(r, str) for r in src_rids):
            raise ValueError("src_rids must be a non-empty list of request ids")
        self.joins.append((time.monotonic(), len(src_rids)))

    def apply(self, obj: GenerateReqInput) -> None:
        """Remember `obj`'s commits; rewrite a prompt that completes a pending join into its marked form."""
        texts = obj.text if isinstance(obj.text, list) else [obj.text]
        if not all(isinstance(t, str) and t and not any(m in t for m in self.markers) for t in texts):
            return
        if self._generates_nothing(obj):
            for text in texts:
                self.commits[text] = None
                self.commits.move_to_end(text)
                if len(self.commits) > MAX_COMMITS:
                    self.commits.popitem(last=False)
        self._expire()
        if not self.joins:
            return
        marked = [self._mark(t) or t for t in texts]
        if marked != texts:
            obj.text = marked if isinstance(obj.text, list) else marked[0]

    @staticmethod
    def _generates_nothing(obj: GenerateReqInput) -> bool:
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        return all(isinstance(p, dict) and p.get("max_new_tokens") == 0 for p in params)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.joins and now - self.joins[0][0] > JOIN_TTL_S:
            self.joins.popleft()

    def _mark(self, text: str) -> str | None:
        """`text` as P, then statements S_i that were committed as P + S_i, then the rest, or None. The client
        commits P + S_i, not always P itself: P is the longest prefix of the first fork's text after which `text`
        reads as exactly as many committed statements as a pending join has forks."""
        counts = {n for _, n in self.joins}
        for first in sorted((c for c in self.commits if len(c) < len(text) and text.startswith(c)), key=len,
                            reverse=True):
            others = [_common(first, c) for c in self.commits if c != first]
            for cut in range(max(others, default=-1), -1, -1):
                statements = self._statements(first[:cut], text, max(counts))
                if len(statements) in counts:
                    self._consume(len(statements))
                    end = cut + sum(map(len, statements))
                    body = "".join(self.statement_open + s for s in statements)
                    return text[:cut] + body + (self.close + text[end:] if end < len(text) else "")
        return None

    def _statements(self, prefix: str, text: str, most: int) -> list[str]:
        """The longest committed statements behind `prefix` that `text` continues with, in order, at most `most`."""
        found = sorted((c[len(prefix):] for c in self.commits if len(c) > len(prefix) and c.startswith(prefix)),
                       key=len, reverse=True)
        out, pos = [], len(prefix)
        while len(out) < most:
            nxt = next((s for s in found if text.startswith(s, pos)), None)
            if nxt is None:
                break
            out.append(nxt)
            pos += len(nxt)
        return out

    def _consume(self, count: int) -> None:
        for i, (_, n) in enumerate(self.joins):
            if n == count:
                del self.joins[i]
                return


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
