"""Query-driven selection: each request chooses the span tokens it recomputes from its own question's attention.

A request with spans that have a query share and select by `query` (span_policy.py) is first prefilled as its other
settings give it: spans read from their jobs, seams recomputed, and its question (the text after its last span)
computed in full, never read from the cache. That probe pass samples nothing; every layer scores how much attention
the question pays to each position (layers/attention_probe.py). When it completes, the request's KV goes to the
radix tree like any prefill's and the request chooses: of the span tokens no run covers yet, in those spans, it
takes the sum over those spans of share x span length, in aligned blocks (SELECT_BLOCK) highest summed score first
(the earlier block on ties, so the same request chooses the same tokens; the last block taken is cut to the budget),
adds them to its spans' recomputed runs, and is re-keyed exactly as if the client had sent those runs
(`span_recompute`). It then waits at the front of the queue and is prefilled again: what comes before its first
newly chosen token (its prefix, earlier seams) is a cache hit, the rest is computed with the chosen tokens attending
to everything before them. Spans that select by `deviation` in the same request have chosen before its probe pass
(span_deviation.py): each pass fills the budget of its own spans.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sglang_pic.managers.io_struct import runs_span_adapter, wire_segments
from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.radix_ext.segments import Segment, canonicalize

# Tokens are chosen in aligned blocks of a span, ranked by the block's summed score: every chosen run is a radix key
# and two pieces of the request, so single scattered tokens would cut a span into hundreds of pieces (on the H200
# RAG workload that host work held the probe to 5 samples/s).
SELECT_BLOCK = 16


def choose(segments: tuple[Segment, ...], scores: np.ndarray, select: str) -> list[Segment]:
    """The canonical prompt `segments` with the chosen tokens added to the runs of its spans that `select` scores
    (see the module doc; the others keep their share for their own pass); `scores`: one per prompt position."""
    blocks, spans, budget, at = [], [], 0.0, 0
    for i, seg in enumerate(segments):
        n = len(seg.token_ids)
        if seg.kind == "span" and seg.query_share > 0 and seg.select == select:
            covered = np.zeros(n, dtype=bool)
            for start, length in seg.recompute:
                covered[start : start + length] = True
            for lo in range(0, n, SELECT_BLOCK):
                free = at + lo + np.flatnonzero(~covered[lo : lo + SELECT_BLOCK])
                if free.size:
                    blocks.append((-float(scores[free].sum()), int(free[0]), free))
            spans.append((i, at))
            budget += seg.query_share * n
        at += n
    if not spans:
        return list(segments)
    left, picked = int(round(budget)), []
    for _, _, free in sorted(blocks, key=lambda b: b[:2]):
        if left <= 0:
            break
        picked.append(free[:left])
        left -= len(picked[-1])
    chosen = np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)
    out = list(segments)
    for i, start in spans:
        seg = segments[i]
        mine = chosen[(chosen >= start) & (chosen < start + len(seg.token_ids))] - start
        runs = seg.recompute + tuple((int(o), 1) for o in mine)
        out[i] = replace(seg, recompute=runs, query_share=0.0)
    return canonicalize(out)


def rekey(req: Req) -> None:
    """After the probe pass (its KV already handed to the tree and its row released): the request's segments as its
    chosen runs key them; its probe-pass counts are kept for what it reports."""
    req.probe_counts = (req.cached_prefix_tokens, req.cached_span_tokens, req.recomputed_span_tokens)
    take_choice(req, req.probe_scores.cpu().numpy(), "query")
    req.probe_scores = None


def take_choice(req: Req, scores: np.ndarray, select: str) -> None:
    """Re-key a request in its probe form (its KV released) with the runs `choose` takes for `scores`, one per
    prompt position, in the spans that `select` scores. It is a plain request from then on, unless spans another
    pass scores are left: it keeps its probe form for that pass."""
    segments = choose(req.probe, scores, select)
    # In its probe form the request keeps a span, so it ran under the adapter exactly when one is served apart.
    req.span_adapter = runs_span_adapter(segments, req.span_adapter)
    req.segments = [ReqSegment.from_wire(seg) for seg in wire_segments(segments, req.span_adapter)]
    req.probe = tuple(segments) if any(seg.query_share for seg in segments) else None


def add_probe_counts(req: Req) -> None:
    """After a match of a probed request: it reports what the cache held before its probe pass, the prompt tokens
    its second prefill computes (`probe_tokens`, with any deviation pass's), and the span tokens it computed itself
    in either pass, once each: those this match misses, and those it finds that the probe pass computed (at most as
    many as it computed)."""
    if req.probe_counts is None:
        return
    prefix, span, computed = req.probe_counts
    req.probe_tokens = req.deviation_tokens + req.prompt_len - req.cached_prefix_tokens - req.cached_span_tokens
    own = sum(n for seg in req.segments for _, n in seg.span_runs)
    req.recomputed_span_tokens += min(computed, own - req.recomputed_span_tokens)
    req.cached_prefix_tokens, req.cached_span_tokens = prefix, span
