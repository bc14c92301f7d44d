"""Turn the scheduler's choice for one step into a ForwardBatch: prefill entries first, then the decode group.

Sized for hundreds of running requests: decodes are one group rather than an object per request, each per-token
or per-request field is built by a list operation over the whole batch, and every integer the forward reads goes
to the device in one upload.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from sglang_pic.forward_batch import BatchRows, ForwardBatch, ForwardMode
from sglang_pic.kernels.paged_layout import SpanScaling
from sglang_pic.kernels.shared_decode_plan import SharedDecodePlan
from sglang_pic.layers.attention_probe import AttentionProbe, ProbeRows
from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.managers.shared_decode_planner import KeyRun, SharedDecodeSettings, plan_shared_decode


@dataclass
class BatchEntry:
    """One request's prefill share of a step: counts[i] new tokens for segment i, taken in logical order."""

    req: Req
    counts: list[int]
    positions: list[int] = field(default_factory=list)
    attn_lo: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    completes: bool = False  # after this step the request has no pending token: sample its next token
    resumes: bool = False  # a running request's forced tokens (jump-forward), not a prefill: it is running already
    logprob_positions: list[int] = field(default_factory=list)  # positions whose logits score the next input token
    slots: torch.Tensor | None = None  # KV slots of the new tokens, in the order of `positions`

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass
class DecodeGroup:
    """The running requests' share of a step: each feeds its last sampled token at position seq_len - 1."""

    reqs: list[Req]
    slots: torch.Tensor  # [B] KV slot of each request's new token, on the device (already in req_to_token)


@dataclass
class StepPlan:
    """What one forward runs. Logits rows follow the same order: the entries' rows, then one row per decode."""

    entries: list[BatchEntry]
    decode: DecodeGroup | None = None

    def __bool__(self) -> bool:
        return bool(self.entries) or self.decode is not None


def plan_entry(req: Req, budget: int) -> BatchEntry:
    """Take up to `budget` of the request's pending tokens, earliest positions first."""
    counts = []
    entry = BatchEntry(req=req, counts=counts)
    left = budget
    for seg in req.segments:
        n = min(len(seg.tokens) - seg.done, left)
        counts.append(n)
        if n > 0:
            first = seg.start + seg.done
            entry.positions.extend(range(first, first + n))
            entry.attn_lo.extend([seg.attn_lo] * n)
            entry.input_ids.extend(seg.tokens[seg.done : seg.done + n])
            left -= n
    entry.completes = req.pending() == entry.num_tokens
    if req.needs_input_logprobs() and req.probe is None:  # a probe pass's logits are not the request's
        lo = max(req.logprob_start_len - 1, 0)
        entry.logprob_positions = [p for p in entry.positions if lo <= p <= req.prompt_len - 2]
    return entry


def _is_decode_entry(e: BatchEntry) -> bool:
    """A one-token prefill at the end of its request that sees every key is a decode for the kernels."""
    return e.num_tokens == 1 and e.attn_lo[0] == 0 and e.positions[0] == e.req.seq_len() - 1


def _add_entry(rows: BatchRows, e: BatchEntry) -> None:
    start = rows.num_tokens
    rows.logits_indices += [start + e.positions.index(p) for p in e.logprob_positions]
    # The last position is never a logprob position (they end at prompt_len - 2).
    if e.completes and e.req.samples():
        rows.logits_indices.append(start + e.num_tokens - 1)
    rows.input_ids += e.input_ids
    rows.add(e.req.req_pool_idx, e.positions, e.attn_lo, span_adapter=e.req.span_adapter)


def _add_decodes(rows: BatchRows, reqs: list[Req]) -> None:
    """One row per request, each a whole-list operation over the group rather than a loop per request."""
    tails = [r.segments[-1] for r in reqs]
    first, n = rows.num_tokens, len(reqs)
    seq_lens = [t.start + t.done for t in tails]  # alloc_decode has counted the new token
    rows.input_ids += [0] * n  # filled on the device from the rows' last sampled tokens
    rows.positions += [s - 1 for s in seq_lens]
    rows.attn_lo += [0] * n
    rows.span_adapter_rows += [int(r.span_adapter) for r in reqs]
    rows.req_pool_indices += [r.req_pool_idx for r in reqs]
    rows.seq_lens += seq_lens
    rows.extend_seq_lens += [1] * n
    rows.logits_indices += range(first, first + n)


def shared_decode_plan(
    reqs: list[Req], seq_lens: list[int], settings: SharedDecodeSettings | None, device: torch.device
) -> SharedDecodePlan | None:
    """The decodes' keys as runs the kernel may read once for several requests (kernels/shared_decode.py), or None."""
    if settings is None or len(reqs) < 2:
        return None
    runs = decode_runs(reqs, settings.min_shared)
    if sum(map(bool, runs)) < 2:
        return None
    rows = [r.req_pool_idx for r in reqs]
    return plan_shared_decode(rows, seq_lens, runs, settings, device)


def decode_runs(reqs: list[Req], shortest: int) -> list[list[KeyRun]]:
    """Each request's tree-owned keys as runs that name their slots, for segments with `shortest`+ cached tokens.

    A segment's first `cached` tokens hold the slots of the tree path ending at its lock node, whatever the offset.
    The path is cut at its nodes, so requests that share only its first nodes (a system prompt before different
    questions) share those; consecutive nodes with as many holders in the batch stay one run (every holder of the
    deeper one holds the other), named by the deeper node and its length."""
    paths: list[list[tuple[int, list[tuple[object, int]]]]] = []
    holders: dict[object, int] = {}
    for req in reqs:
        mine = []
        for seg in req.segments:
            if seg.cached >= shortest:
                nodes = _tree_path(seg)
                mine.append((seg.start, nodes))
                for node, _ in nodes:
                    holders[node] = holders.get(node, 0) + 1
        paths.append(mine)
    runs: list[list[KeyRun]] = []
    for mine in paths:
        request_runs = []
        for at, nodes in mine:
            i = 0
            while i < len(nodes):
                node, length = nodes[i]
                count = holders[node]
                while i + 1 < len(nodes) and holders[nodes[i + 1][0]] == count:
                    i += 1
                    node, length = nodes[i][0], length + nodes[i][1]
                request_runs.append(KeyRun(node, at, length))
                at += length
                i += 1
        runs.append(request_runs)
    return runs


def _tree_path(seg: ReqSegment) -> list[tuple[object, int]]:
    """(node, tokens) from the segment's tree root down to its lock node; none when the path does not add up to
    the segment's cached tokens, so those keys stay private: a run's name must stand for the same slots in every
    request, and a (node, length) pair here names the path's last `length` tokens. A span tail's path starts with
    its key lead (the head the request recomputed, not in its row): those tokens are cut off the front."""
    nodes = []
    node = seg.lock_node
    while not node.is_root:
        nodes.append((node, len(node.key)))
        node = node.parent
    lead = len(seg.key_lead)
    if sum(n for _, n in nodes) != seg.cached + lead:
        return []
    nodes.reverse()
    while lead:
        first, n = nodes[0]
        if n <= lead:
            nodes.pop(0)
            lead -= n
        else:
            nodes[0] = (first, n - lead)
            lead = 0
    return nodes


def _probe(entries: list[BatchEntry], device: torch.device) -> AttentionProbe | None:
    """The question rows of the entries in a probe pass (managers/span_probe.py), or None. An entry holding the
    question's first token starts its request's scores afresh: a probe pass computes the whole question, again
    when it is retracted and admitted anew."""
    items, row = [], 0
    for e in entries:
        req = e.req
        if req.probe is not None and e.positions and e.positions[-1] >= req.question_start:
            first = bisect_left(e.positions, req.question_start)
            if e.positions[first] == req.question_start:
                req.probe_scores = torch.zeros(req.prompt_len, dtype=torch.float32, device=device)
            seq_len = e.positions[-1] + 1
            scores = torch.zeros(seq_len, dtype=torch.float32, device=device)
            items.append(ProbeRows(row + first, row + e.num_tokens, req.req_pool_idx, seq_len, scores,
                                   req.probe_scores))
        row += e.num_tokens
    return AttentionProbe(items) if items else None


def span_scaling(reqs: list[Req], device: torch.device) -> SpanScaling | None:
    """APE's scaling for the batch's requests `reqs` (in batch order), or None when none asks for it: a request's
    span pieces with equal factors are one group, numbered in order of first appearance."""
    ranges, starts, groups, factors = [], [0], [], []
    for r in reqs:
        mine: list[tuple[float, float]] = []
        for lo, hi, pair in r.span_ranges():
            if pair not in mine:
                mine.append(pair)
            ranges.append((lo, hi))
            groups.append(mine.index(pair))
            factors.append(pair)
        starts.append(len(ranges))
    if not ranges:
        return None
    temperature, scale = torch.tensor(factors, dtype=torch.float32).T
    ints = [torch.tensor(values, dtype=torch.int64).to(device) for values in (ranges, starts, groups)]
    return SpanScaling(*ints, temperature.contiguous().to(device), scale.contiguous().to(device), max(groups) + 1)


def build_forward_batch(
    plan: StepPlan, runner, next_input_ids: torch.Tensor, shared_decode: SharedDecodeSettings | None
) -> ForwardBatch:
    """Flatten the plan into token rows; logits rows are the logprob positions plus each sampled last token.
    `next_input_ids` [request rows] holds each row's last sampled token on the device; `shared_decode`: how the
    decodes may share KV reads (None: they do not)."""
    rows = BatchRows()
    for e in plan.entries:
        _add_entry(rows, e)
    slots = [e.slots for e in plan.entries]
    n = 0 if plan.decode is None else len(plan.decode.reqs)
    if plan.decode is not None:
        _add_decodes(rows, plan.decode.reqs)
        slots.append(plan.decode.slots)
    is_decode = all(_is_decode_entry(e) for e in plan.entries)
    scaling = span_scaling([e.req for e in plan.entries] + (plan.decode.reqs if n else []), runner.device)
    shared = None
    if n and scaling is None and not (is_decode and plan.entries):  # the plan covers exactly the decode rows
        decode_lens = rows.seq_lens[len(rows.seq_lens) - n :]
        shared = shared_decode_plan(plan.decode.reqs, decode_lens, shared_decode, runner.device)
    batch = ForwardBatch.build(
        ForwardMode.DECODE if is_decode else ForwardMode.EXTEND,
        rows,
        slots[0] if len(slots) == 1 else torch.cat(slots),
        runner.device,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=runner.attn_backend,
        num_decode_tail=n if not is_decode else 0,
        shared_decode=shared,
    )
    batch.probe = _probe(plan.entries, runner.device)
    batch.span_scaling = scaling
    if n:  # each decode feeds its row's last sampled token, which may not be on the host yet
        total = batch.input_ids.numel()
        batch.input_ids[total - n :] = next_input_ids[batch.req_pool_indices[batch.batch_size - n :]]
    return batch
