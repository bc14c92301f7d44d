"""A request's state inside the scheduler: its segments, which of their tokens have KV, and its output.

A request's logical token sequence is the concatenation of its segments' tokens; generated tokens are appended to
the tail segment (the last prefix/PDEP segment, or an implicit PDEP segment after a trailing span). Token j of the
sequence has RoPE position j and KV slot req_to_token[req_pool_idx, j]. For each segment the request tracks how
many leading tokens have KV (`done`), and how many of those belong to the radix tree (`cached`, locked through
`lock_node`); slots in [cached, done) belong to the request until it inserts them (listed in `own`).

A span's quality settings (span_policy.py) show here as pieces: "head" segments, runs of the span's tokens the
request recomputes with full attention (its first tokens, say), and between them span segments whose radix keys
start with the span's anchor and every span token before them (`key_lead`): the tree holds the whole anchored span
as its job computed it, and the request reads only those pieces' slots. A span with an anchor or recomputed runs is
never computed in a request's row (`from_job`); a span job computes its whole key (`span_id`).

A request whose spans have a query share (span_policy.py) runs twice: a probe pass of the prompt as its other
settings give it, whose question (the text after the last span) scores the span tokens, then the prompt re-keyed
with the tokens the probe chose to recompute (managers/span_probe.py). `probe` holds the canonical prompt until
the probe has chosen.

A Req holds scheduler state only. It is built from the tokenizer's wire message (`Req.from_wire`, one path for the
server's scheduler process and the offline Engine); what only the client's side needs (streaming, the arrival time,
the stream cursors, the decoded text) stays with the output (managers/output_format.py). The outputs the scheduler
itself produces do live here: the output ids, the logprobs it computes, the finish reason and the cache counts are
filled in step by step, and the scheduler reads them back (stop checks, penalties, prompt-logprob progress).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch

from sglang_pic.managers.io_struct import TokenizedGenerateReq, TokenizedSegment
from sglang_pic.radix_ext.radix_tree import RadixKey
from sglang_pic.radix_ext.segments import Segment
from sglang_pic.sampling.sampling_params import SamplingParams


@dataclass(eq=False)
class ReqSegment:
    kind: str  # "prefix" | "span" | "pdep" | "head" (a span's recomputed head: attends like PDEP text)
    tokens: list[int]
    extra_key: str | None  # radix namespace (see radix_ext.segments)
    start: int = 0  # logical index of the first token
    key_lead: tuple[int, ...] = ()  # a span piece: its key's leading tokens (the anchor, the span's tokens before)
    span_rest: tuple[int, ...] = ()  # a span piece: the span's tokens after it (span_id names the whole span)
    span_runs: tuple[tuple[int, int], ...] = ()  # (offset, length) runs of span text the request computes itself
    attention: tuple[float, float] = (1.0, 1.0)  # a span piece: APE's (temperature, scale) for reading it
    done: int = 0  # leading tokens whose KV is in the request's row
    cached: int = 0  # leading tokens owned by the radix tree (locked via lock_node)
    lock_node: Any = None
    # Slot of token done-1, so allocation continues the segment's page; -1 when the next token starts a fresh page
    # (none yet, or a full one: a full page's last slot is never needed, and reading it from the device would sync).
    last_slot: int = -1
    # Slots of tokens [cached, done), the ones the request owns, kept on the host as they are allocated: freeing
    # them never reads the request's row back from the device (which would wait for the step in flight).
    own: array = field(default_factory=lambda: array("q"))

    @classmethod
    def from_wire(cls, seg: TokenizedSegment) -> "ReqSegment":
        """A segment with no KV yet; its own copy of the tokens (a tail segment grows by the output)."""
        return cls(
            seg.kind, list(seg.tokens), seg.extra_key, seg.start, seg.key_lead, seg.span_rest, seg.span_runs,
            seg.attention,
        )

    def span_tokens_from(self, offset: int) -> int:
        """How many of its span-text tokens (span_runs) lie at `offset` or later: those a cache hit of `offset`
        leading tokens leaves the request to compute."""
        return sum(max(start + n - max(start, offset), 0) for start, n in self.span_runs)

    @property
    def attn_lo(self) -> int:
        return self.start if self.kind == "span" else 0

    @property
    def from_job(self) -> bool:
        """A span whose KV only a span job computes (see the module doc): the request waits for it."""
        return self.kind == "span" and bool(self.key_lead)

    @property
    def span_id(self) -> tuple:
        """What identifies a span's KV across requests (and the job computing it): its namespace and the tokens of
        the whole span's key, around this piece of it too."""
        return (self.extra_key, self.key_lead + tuple(self.tokens) + self.span_rest)

    def key(self, length: int | None = None) -> RadixKey:
        toks = self.tokens if length is None else islice(self.tokens, length)  # one copy, not a slice then a tuple
        return RadixKey(self.key_lead + tuple(toks), self.extra_key)


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None
    cut: int = 0  # a stop string or regex: trailing characters of the output text it cuts off (from its start)

    def to_json(self) -> dict:
        out: dict = {"type": self.type, "matched": self.matched}
        if self.message:
            out["message"] = self.message
        return out


@dataclass(eq=False)  # identity semantics: requests are compared and looked up in queues by object
class Req:
    rid: str
    segments: list[ReqSegment]
    sampling_params: SamplingParams
    prompt_len: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # ids whose logprobs each scored position returns (with logprobs)
    eos_token_ids: set[int] = field(default_factory=set)
    spec_stats: Any = None  # speculative.spec_stats.ReqSpecStats while VeriCache decodes this request
    priority: int | None = None  # the client's; only read with --enable-priority-scheduling (waiting_order.WaitingOrder.urgency)
    preemptions: int = 0  # times a more urgent request preempted it: the scheduler spreads preemptions

    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    req_pool_idx: int | None = None
    generator: Any = None
    first_token_time: float | None = None
    cached_prefix_tokens: int = 0
    cached_span_tokens: int = 0
    recomputed_span_tokens: int = 0  # span tokens this request computes itself (heads, short spans) the cache missed
    matched_once: bool = False
    # Logprobs collected so far.
    input_token_logprobs: list = field(default_factory=list)  # (logprob|None, token_id)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)  # per position [(logprob, id)] of token_ids_logprob
    output_token_ids_logprobs: list = field(default_factory=list)
    input_logprobs_done: bool = False
    # A span prefill job (ISPS or warm-up): computes its span's KV into the tree, samples nothing.
    warmup: bool = False
    span_id: tuple | None = None  # a span job's (namespace, tokens): what identifies the KV it computes
    # The output grammar's matcher (sampling/grammar.py), built by the scheduler: it has accepted the output so far.
    grammar: Any = field(default=None, repr=False, compare=False)
    arrival_step: int = 0
    # The probe pass (see the module doc): the canonical prompt until the probe has chosen, where its question
    # starts, the question's attention to each prompt position so far, and the probe pass's cache counts
    # (cached prefix, cached span and computed span tokens), which the request reports.
    probe: tuple[Segment, ...] | None = None
    question_start: int = 0
    probe_scores: Any = field(default=None, repr=False)
    probe_counts: tuple[int, int, int] | None = None
    probe_tokens: int = 0  # prompt tokens the prefill after the probe computes (all of them computed twice)
    deviation_tokens: int = 0  # its deviation pass (span_deviation.py), in whole-model token equivalents
    span_adapter: bool = False  # its rows run under the span adapter (io_struct.runs_span_adapter; span jobs do)

    @classmethod
    def from_wire(cls, msg: TokenizedGenerateReq) -> "Req":
        """The scheduler's request for a tokenized one: its own segments, its seeded generator, no KV yet."""
        generator = None
        if msg.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(msg.seed)
        return cls(
            rid=msg.rid,
            segments=[ReqSegment.from_wire(seg) for seg in msg.segments],
            sampling_params=msg.sampling_params,
            prompt_len=msg.prompt_len,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            eos_token_ids=msg.eos_token_ids,
            priority=msg.priority,
            generator=generator,
            probe=msg.probe,
            span_adapter=msg.span_adapter,
            question_start=_question_start(msg.probe) if msg.probe is not None else 0,
        )

    def span_ranges(self) -> list[tuple[int, int, tuple[float, float]]]:
        """The [start, end) positions and APE factors of its scaled span pieces, read as they were encoded apart
        from it (its recomputed tokens are its own text): the keys APE scales."""
        return [(seg.start, seg.start + len(seg.tokens), seg.attention) for seg in self.segments
                if seg.kind == "span" and seg.attention != (1.0, 1.0)]

    # ---- derived views -------------------------------------------------------------------------------------
    @property
    def tail(self) -> ReqSegment:
        return self.segments[-1]

    def seq_len(self) -> int:
        tail = self.segments[-1]
        return tail.start + len(tail.tokens)

    def prompt_ids(self) -> list[int]:
        ids: list[int] = []
        for seg in self.segments:
            ids.extend(seg.tokens)
        return ids[: self.prompt_len]

    def all_ids(self) -> list[int]:
        ids: list[int] = []
        for seg in self.segments:
            ids.extend(seg.tokens)
        return ids

    def pending(self) -> int:
        """Tokens still without KV (for a decoding request: exactly 1, the last sampled token)."""
        return sum(len(s.tokens) - s.done for s in self.segments)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def needs_input_logprobs(self) -> bool:
        return self.return_logprob and not self.input_logprobs_done and 0 <= self.logprob_start_len < self.prompt_len

    def reuse_limit(self) -> int | None:
        """The first prompt position whose KV must be computed here rather than reused from the cache: its logits
        give a prompt logprob the request returns, or it is the probe's question (scored only when computed).
        None: everything may be reused."""
        limit = max(self.logprob_start_len - 1, 0) if self.needs_input_logprobs() else None
        if self.probe is not None:
            limit = self.question_start if limit is None else min(limit, self.question_start)
        return limit

    def samples(self) -> bool:
        """Whether the request samples a token once its prefill completes (not a span job, not a probe pass)."""
        return not self.warmup and self.probe is None

    def reuses_whole(self, seg: ReqSegment) -> bool:
        """Whether the request may take all of `seg`'s KV from the cache (else it computes the rest itself)."""
        limit = self.reuse_limit()
        return limit is None or seg.start + len(seg.tokens) <= limit

    def cached_tokens(self) -> int:
        return self.cached_prefix_tokens + self.cached_span_tokens

    def append_output(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.segments[-1].tokens.append(token_id)  # self.tail without a property call: runs per request per step


def _question_start(segments: tuple[Segment, ...]) -> int:
    """The position after the canonical prompt's last span: where its question starts."""
    at = end = 0
    for seg in segments:
        at += len(seg.token_ids)
        if seg.kind == "span":
            end = at
    return end
