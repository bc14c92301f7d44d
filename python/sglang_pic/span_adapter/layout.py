"""Span attention as one flat sequence with an explicit mask and positions: what the engine computes for a request.

For every span the sequence holds a hidden copy of what the span's job computed: the anchor at the positions right
before the span, then the span's tokens before this piece (a recomputed head, as the job saw it). A span piece's
tokens attend to that copy and to themselves; every other token (prefix, PDEP text, recomputed heads, the output)
attends to every visible token before it, never to a hidden one. The engine's reference tests check that its outputs
equal an HF model run on this layout (test/test_span_policy.py), and span-adapter training runs its student on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SpanLayout:
    """A request's flat sequence: token ids, logical positions, each token's scope (None: it sees every visible
    token before it; a span piece's number: it sees that piece's hidden copy and tokens) and whether later tokens
    see it (False for hidden copies)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    scope: list[int | None] = field(default_factory=list)
    visible: list[bool] = field(default_factory=list)

    def add(self, tokens: Sequence[int], first: int, scope: int | None, visible: bool) -> None:
        self.ids.extend(tokens)
        self.positions.extend(range(first, first + len(tokens)))
        self.scope.extend([scope] * len(tokens))
        self.visible.extend([visible] * len(tokens))

    def append_output(self, tokens: Sequence[int]) -> None:
        """Generated tokens: the request's own, after everything."""
        self.add(tokens, self.positions[-1] + 1 if self.positions else 0, None, True)

    def mask(self) -> torch.Tensor:
        return layout_mask(self.scope, self.visible)

    def dense_ids(self) -> list[int]:
        """The same request under full attention: its visible tokens, in order, at positions 0..n-1."""
        return [t for t, v in zip(self.ids, self.visible) if v]

    def dense_index(self) -> list[int]:
        """For each token of the layout, its index in dense_ids() (-1 for a hidden copy)."""
        out, n = [], 0
        for v in self.visible:
            out.append(n if v else -1)
            n += v
        return out


def segments_layout(segments) -> SpanLayout:
    """A request's segments (Req.segments: kind, tokens, start, key_lead) as the flat layout."""
    layout = SpanLayout()
    for n, seg in enumerate(segments):
        if seg.kind == "span":
            hidden = list(seg.key_lead)
            layout.add(hidden, seg.start - len(hidden), n, False)
            layout.add(seg.tokens, seg.start, n, True)
        else:
            layout.add(seg.tokens, seg.start, None, True)
    return layout


def layout_mask(scope: Sequence[int | None], visible: Sequence[bool]) -> torch.Tensor:
    """[L, L] boolean: token i attends to token j (causal; a span piece's tokens see their piece and its hidden copy,
    other tokens every visible token)."""
    return scope_mask(scope_ids(scope), torch.tensor(list(visible), dtype=torch.bool))


def scope_ids(scope: Sequence[int | None]) -> torch.Tensor:
    """Scopes as a tensor, -1 for none."""
    return torch.tensor([-1 if s is None else s for s in scope], dtype=torch.long)


def scope_mask(scope: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """layout_mask over tensors [..., L] (scope -1: none), batched and on their device: [..., L, L]."""
    j = torch.arange(scope.shape[-1], device=scope.device)
    same_span = (scope[..., :, None] == scope[..., None, :]) & (scope[..., :, None] >= 0)
    full = (scope[..., :, None] < 0) & visible[..., None, :]
    return (j[None, :] <= j[:, None]) & (same_span | full)
