"""Request objects at the API boundary, with SGLang's field names (`/generate` and `Engine.generate`), and the
tokenized request the request builder makes of them for the scheduler (SGLang's TokenizedGenerateReqInput).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_pic.radix_ext.segments import ADAPTER_NAMESPACE, Segment, recompute_namespaces, segment_keys, tail_key
from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.sglang_fields import GENERATE_ALIASES, GENERATE_FIELDS, accept_fields
from sglang_pic.span_policy import SETTING_FIELDS


@dataclass
class GenerateReqInput:
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None  # one list for every prompt, or one per prompt
    return_text_in_logprobs: bool = False
    stream: bool = False
    data_parallel_rank: int | None = None  # the replica to run on (a server with dp_size > 1; sglang-router --dp-aware)
    priority: int | list[int | None] | None = None  # with --enable-priority-scheduling: larger runs first
    # sglang_pic: the span quality settings of these prompts (span_policy.py); None: the server's.
    span_anchor: str | list[str | None] | None = None
    span_head_tokens: int | list[int | None] | None = None
    span_tail_tokens: int | list[int | None] | None = None
    span_query_share: float | list[float | None] | None = None
    span_select: str | list[str | None] | None = None
    span_attention_temperature: float | list[float | None] | None = None
    span_attention_scale: float | list[float | None] | None = None

    @classmethod
    def from_json(cls, body: Any) -> "GenerateReqInput":
        """SGLang's other fields are accepted at their neutral values (sglang_fields); null means the default."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        fields = accept_fields(body, _FIELD_NAMES, GENERATE_FIELDS, GENERATE_ALIASES)
        return cls(**{k: v for k, v in fields.items() if v is not None})

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def batch_size(self) -> int:
        if self.text is None and self.input_ids is None:
            raise ValueError("either text or input_ids is required")
        if self.text is not None and self.input_ids is not None:
            raise ValueError("give either text or input_ids, not both")
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)

    def _prompt_part(self, value: Any, i: int) -> Any:
        """Prompt i's text or input_ids (None when the batch gives the other)."""
        if not self.is_batch:
            return value
        return value[i] if value is not None else None

    def item(self, i: int) -> dict:
        """The i-th request of a (possibly) batched input, as plain values."""
        batch = self.is_batch

        def pick(value: Any) -> Any:
            if batch and isinstance(value, list):
                if len(value) != self.batch_size():
                    raise ValueError("batched fields must have one entry per prompt")
                return value[i]
            return value

        # token_ids_logprob: a list of lists holds one per prompt, a flat list applies to every prompt.
        ids = self.token_ids_logprob
        per_prompt = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)

        return {
            "text": self._prompt_part(self.text, i),
            "input_ids": self._prompt_part(self.input_ids, i),
            "sampling_params": pick(self.sampling_params),
            "rid": pick(self.rid),
            "return_logprob": pick(self.return_logprob),
            "logprob_start_len": pick(self.logprob_start_len),
            "top_logprobs_num": pick(self.top_logprobs_num),
            "token_ids_logprob": pick(ids) if per_prompt else ids,
            "priority": pick(self.priority),
            "span_settings": {name: pick(getattr(self, name)) for name in SETTING_FIELDS},
        }


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(GenerateReqInput))


@dataclass
class TokenizedSegment:
    """One segment of a tokenized prompt, as plain data: the scheduler's ReqSegment without its KV bookkeeping.

    kind: "prefix" | "span" | "pdep" | "head" (a span's recomputed head); tokens: its token ids, the segmenter's
    tuples as they are (Req.from_wire makes the one mutable copy); extra_key: its radix namespace
    (radix_ext.segments); start: the logical index of its first token; key_lead: a span tail's key's leading
    tokens (its anchor and the span's tokens before it; managers/req.py); span_rest: the span's tokens after
    such a piece of it, so that the piece names its whole span; span_runs: (offset, length) runs of its tokens
    that are span text the request computes with full attention (a head: all of it), for meta_info's counts;
    attention: a span piece's APE (temperature, scale) (radix_ext.segments.Segment.attention).
    """

    kind: str
    tokens: tuple[int, ...]
    extra_key: str | None
    start: int = 0
    key_lead: tuple[int, ...] = ()
    span_rest: tuple[int, ...] = ()
    span_runs: tuple[tuple[int, int], ...] = ()
    attention: tuple[float, float] = (1.0, 1.0)


def runs_span_adapter(segments: Sequence[Segment], apart: bool) -> bool:
    """Whether a canonical prompt runs under the span adapter: one is served apart from the weights (`apart`) and
    a span is left after the prompt's settings (a prompt whose spans are all recomputed whole attends densely)."""
    return apart and any(seg.kind == "span" for seg in segments)


def wire_segments(segments: Sequence[Segment], span_adapter: bool = False) -> list[TokenizedSegment]:
    """A span with recomputed runs becomes its pieces: each run a "head" segment, keyed like PDEP text on the
    structure before it (radix_ext.segments.recompute_namespaces), and each stretch between runs a span segment
    read from the tree path of the whole anchored span (see managers/req.py). `span_adapter`: the prompt runs
    under the span adapter (`runs_span_adapter`), so its plain keys move to ADAPTER_NAMESPACE."""
    out, start = [], 0
    for seg, key, spaces in zip(segments, segment_keys(segments), recompute_namespaces(segments)):
        tokens = seg.token_ids
        if seg.kind != "span":
            out.append(TokenizedSegment(seg.kind, tokens, key.extra_key, start=start, span_runs=seg.span_runs))
        else:
            anchor_len, runs = len(key.token_ids) - len(tokens), iter(spaces)
            for recomputed, a, b in seg.pieces():
                if recomputed:
                    piece = TokenizedSegment("head", tokens[a:b], next(runs), start + a, span_runs=((0, b - a),))
                else:
                    lead = key.token_ids[: anchor_len + a]
                    piece = TokenizedSegment(
                        "span", tokens[a:b], key.extra_key, start + a, key_lead=lead, span_rest=tokens[b:],
                        attention=seg.attention,
                    )
                out.append(piece)
        start += len(tokens)
    if out[-1].kind == "span":
        out.append(TokenizedSegment("pdep", (), tail_key(segments, ()).extra_key, start=start))
    return adapter_keyed(out) if span_adapter else out


def adapter_keyed(segments: list[TokenizedSegment]) -> list[TokenizedSegment]:
    """The segments of a prompt under the span adapter: their plain keys (namespace None) in ADAPTER_NAMESPACE."""
    return [replace(seg, extra_key=ADAPTER_NAMESPACE) if seg.extra_key is None else seg for seg in segments]


@dataclass
class TokenizedGenerateReq:
    """One validated, tokenized request, as the request builder sends it to a scheduler (pickled over ZMQ from the
    HTTP process, handed over in-process by the offline Engine). It carries what the client asked for and nothing of
    the scheduler's state: the scheduler builds its own Req from it (Req.from_wire). `stream`, `created_time` and
    `return_text_in_logprobs` only shape the output; the scheduler process passes them on to its reports."""

    rid: str
    segments: list[TokenizedSegment]
    sampling_params: SamplingParams
    prompt_len: int
    eos_token_ids: set[int]
    seed: int | None = None  # this copy's sampling seed (sampling_params.seed + its index among n); None: unseeded
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    priority: int | None = None
    data_parallel_rank: int | None = None  # the replica the client asked for; None: the server picks
    stream: bool = False
    return_text_in_logprobs: bool = False
    created_time: float = field(default_factory=time.time)
    # The canonical prompt, when one of its spans has a query share: the scheduler probes the request, then
    # re-keys it with the runs the probe chose (managers/span_probe.py). None: `segments` are final.
    probe: tuple[Segment, ...] | None = None
    span_adapter: bool = False  # its rows run under the span adapter (runs_span_adapter)

    def prompt_ids(self) -> list[int]:
        return [t for seg in self.segments for t in seg.tokens]
