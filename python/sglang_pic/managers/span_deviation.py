"""Deviation-selected recompute (CacheBlend's selection): a request chooses the span tokens it recomputes by how far
their KV with full attention is from the shared copy it would read.

A request with spans that have a query share and select by `deviation` is matched like any other (its spans
from their jobs, its seams its own). Before its prefill, at admission, a deviation pass runs its whole prompt with
full attention through the first DEVIATION_LAYERS layers only, into throwaway slots of a scratch row, and scores
every reused span position at the last of them (layers/deviation_probe.py). The request then chooses and is
re-keyed exactly as after a query probe (span_probe.take_choice: its share in aligned blocks, highest summed score
first, ties to the earlier block), and is matched again. The pass writes no slot that anything reads and frees its
own at once: it leaves only the scores. It costs DEVIATION_LAYERS / num_layers of a dense prefill of the prompt.
"""

from __future__ import annotations

import torch

from sglang_pic.layers.deviation_probe import DeviationProbe
from sglang_pic.managers.req import Req
from sglang_pic.managers.req_kv import ReqKVManager
from sglang_pic.managers.span_probe import take_choice

# CacheBlend reads the deviation after its first layer's attention; the second layer's KV is the first that depends
# on the context, and so the first that can deviate.
DEVIATION_LAYERS = 2


def wants_deviation_pass(req: Req) -> bool:
    return req.probe is not None and any(s.query_share > 0 and s.select == "deviation" for s in req.probe)


def compared_positions(req: Req) -> list[int]:
    """The positions of a matched request whose KV it reads from the shared span copy."""
    return [p for seg in req.segments if seg.kind == "span" for p in range(seg.start, seg.start + seg.cached)]


def deviation_scores(req: Req, runner, kv: ReqKVManager) -> torch.Tensor | None:
    """The deviation pass of a matched request: one score per prompt position (0 off the compared ones), or None
    when no scratch row or no slots for its prompt are free."""
    n = req.prompt_len
    # The row first: a pass that cannot get one must not evict cached KV for its slots.
    if kv.req_to_token_pool.available_size() == 0 or not kv.ensure_free(n):
        return None
    with runner.scratch_prefill(req.prompt_ids(), req.span_adapter) as batch:
        if batch is None:
            return None
        layer = min(DEVIATION_LAYERS, runner.model_config.num_hidden_layers) - 1
        positions = compared_positions(req)
        shared = kv.req_to_token_pool.req_to_token[req.req_pool_idx, positions].tolist()
        batch.deviation = DeviationProbe(layer, positions, shared,
                                         torch.zeros(n, dtype=torch.float32, device=runner.device))
        return runner.forward_deviation(batch)


def select_by_deviation(req: Req, runner, kv: ReqKVManager) -> bool:
    """Run a matched request's deviation pass, release its KV and re-key it with the runs its scores choose; False
    (nothing changed) when the pass does not fit now. It reports the pass as `probe_tokens`, in whole-model token
    equivalents (prompt tokens x the pass's layers / the model's)."""
    scores = deviation_scores(req, runner, kv)
    if scores is None:
        return False
    kv.release(req)
    take_choice(req, scores.cpu().numpy(), "deviation")
    layers = runner.model_config.num_hidden_layers
    req.deviation_tokens = -(-req.prompt_len * min(DEVIATION_LAYERS, layers) // layers)
    req.probe_tokens = req.deviation_tokens
    return True
