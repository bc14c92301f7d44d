"""A request's output on its way to the client, one mechanism for the server and the offline Engine.

The scheduler's side (`Reporter`, a `ReqReport` per live request) decides after each step which requests report
and what each report (`TokenDelta`) adds. The client's side adds the reports up (`RequestOutputs`, a `ReqOutput` per
live request) and formats the sum (`OutputFormatter`) as SGLang's `/generate` output: text, output_ids, meta_info.
The server's scheduler process sends the reports to its detokenizer process; the Engine hands them over in-process.
So both trim stop strings, hold back partial characters and write logprobs (with or without their tokens' text)
exactly alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sglang_pic.managers.io_struct import TokenizedGenerateReq
from sglang_pic.managers.ipc import ReqHeader, TokenDelta
from sglang_pic.managers.req import FinishReason, Req
from sglang_pic.tokenizer import DecodeWindow, fast_decode, plain_backend


# ---- the scheduler's side -------------------------------------------------------------------------------------
@dataclass
class ReqReport:
    """What has been reported of one request, and the client's asks that shape its reports."""

    stream: bool = False
    created_time: float = field(default_factory=time.time)
    return_text_in_logprobs: bool = False
    sent: int = 0  # output ids reported so far
    headed: bool = False  # the header went out (with the first report)
    done: bool = False  # the finished request has been reported

    @classmethod
    def of(cls, msg: TokenizedGenerateReq) -> "ReqReport":
        return cls(msg.stream, msg.created_time, msg.return_text_in_logprobs)

    def due(self, req: Req, interval: int) -> bool:
        """Whether `req` reports now: once when it finishes; while it streams, its first token at once and then
        every `interval` tokens (--stream-interval)."""
        if self.done:
            return False
        if req.finished():
            return True
        produced = len(req.output_ids)
        return self.stream and produced > self.sent and (self.sent == 0 or produced - self.sent >= interval)

    def delta(self, req: Req) -> TokenDelta:
        """The report of what `req` produced since the last one."""
        start, self.sent = self.sent, len(req.output_ids)
        self.done = req.finished()
        header = None
        if not self.headed:
            self.headed = True
            header = ReqHeader(
                prompt_len=req.prompt_len,
                sampling_params=req.sampling_params,
                created_time=self.created_time,
                return_logprob=req.return_logprob,
                return_text_in_logprobs=self.return_text_in_logprobs,
                input_token_logprobs=req.input_token_logprobs,
                input_top_logprobs=req.input_top_logprobs,
                token_ids_logprob=req.token_ids_logprob,
                input_token_ids_logprobs=req.input_token_ids_logprobs,
            )
        return TokenDelta(
            rid=req.rid,
            new_ids=req.output_ids[start:],
            finished_reason=req.finished_reason,
            cached_prefix_tokens=req.cached_prefix_tokens,
            cached_span_tokens=req.cached_span_tokens,
            recomputed_span_tokens=req.recomputed_span_tokens,
            probe_tokens=req.probe_tokens,
            first_token_time=req.first_token_time,
            new_output_token_logprobs=req.output_token_logprobs[start:],
            new_output_top_logprobs=req.output_top_logprobs[start:],
            new_output_token_ids_logprobs=req.output_token_ids_logprobs[start:],
            spec_meta=req.spec_stats.to_meta() if req.spec_stats is not None else None,
            header=header,
        )


class Reporter:
    """The scheduler's side of the live requests' outputs: which of them report now, and what they report."""

    def __init__(self, stream_interval: int) -> None:
        self.interval = stream_interval
        self.reports: dict[str, ReqReport] = {}  # rid -> its reports so far, until the finished one

    def add(self, msg: TokenizedGenerateReq) -> None:
        self.reports[msg.rid] = ReqReport.of(msg)

    def deltas(self, reqs: Iterable[Req]) -> list[TokenDelta]:
        """The reports due among `reqs` (span jobs and requests never added report nothing)."""
        out = []
        for req in reqs:
            report = None if req.warmup else self.reports.get(req.rid)
            if report is not None and report.due(req, self.interval):
                out.append(report.delta(req))
                if report.done:
                    del self.reports[req.rid]
        return out


# ---- the client's side ----------------------------------------------------------------------------------------
@dataclass(eq=False)
class ReqOutput:
    """One request's output as its client sees it: the header, every report so far added up, and the stream's
    decoded text (`decode_window`, see OutputFormatter.text)."""

    rid: str
    header: ReqHeader
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    finished_reason: FinishReason | None = None
    cached_prefix_tokens: int = 0
    cached_span_tokens: int = 0
    recomputed_span_tokens: int = 0
    probe_tokens: int = 0
    first_token_time: float | None = None
    spec_meta: dict | None = None
    decode_window: DecodeWindow | None = None

    def add(self, delta: TokenDelta) -> None:
        self.output_ids.extend(delta.new_ids)
        self.output_token_logprobs.extend(delta.new_output_token_logprobs)
        self.output_top_logprobs.extend(delta.new_output_top_logprobs)
        self.output_token_ids_logprobs.extend(delta.new_output_token_ids_logprobs)
        self.finished_reason = delta.finished_reason
        self.cached_prefix_tokens = delta.cached_prefix_tokens
        self.cached_span_tokens = delta.cached_span_tokens
        self.recomputed_span_tokens = delta.recomputed_span_tokens
        self.probe_tokens = delta.probe_tokens
        self.first_token_time = delta.first_token_time
        self.spec_meta = delta.spec_meta


class RequestOutputs:
    """The client's side of the live requests: a report in, that request's formatted output so far out."""

    def __init__(self, formatter: "OutputFormatter") -> None:
        self.formatter = formatter
        self.live: dict[str, ReqOutput] = {}

    def apply(self, delta: TokenDelta) -> dict[str, Any] | None:
        """The output after `delta`; None for a request whose header never came."""
        if delta.header is not None:
            self.live[delta.rid] = ReqOutput(delta.rid, delta.header)
        out = self.live.get(delta.rid)
        if out is None:
            return None
        out.add(delta)
        if out.finished_reason is not None:
            del self.live[delta.rid]
        return self.formatter.format(out)


def output_of(formatter: "OutputFormatter", msg: TokenizedGenerateReq, req: Req) -> dict[str, Any]:
    """The output of `req` (built from `msg`) in one report, as a request that does not stream gets it."""
    return RequestOutputs(formatter).apply(ReqReport.of(msg).delta(req))


class OutputFormatter:
    """Turns a ReqOutput into SGLang's `/generate` output; without a tokenizer the text is empty."""

    def __init__(self, tokenizer) -> None:
        self._decode = fast_decode(tokenizer) if tokenizer is not None else None
        self._incremental = tokenizer is not None and plain_backend(tokenizer) is not None  # see DecodeWindow
        self._token_texts: dict[int, str] = {}  # see _token_text; at most one entry per vocabulary id

    def format(self, out: ReqOutput) -> dict[str, Any]:
        h = out.header
        meta: dict[str, Any] = {
            "id": out.rid,
            "prompt_tokens": h.prompt_len,
            "completion_tokens": len(out.output_ids),
            "cached_tokens": out.cached_prefix_tokens + out.cached_span_tokens,
            "cached_prefix_tokens": out.cached_prefix_tokens,
            "cached_span_tokens": out.cached_span_tokens,
            "recomputed_span_tokens": out.recomputed_span_tokens,  # span tokens it computed itself (span_policy.py)
            # prompt tokens its selection computed again: a query probe's second prefill, a deviation pass (in
            # whole-model token equivalents)
            "probe_tokens": out.probe_tokens,
            "finish_reason": out.finished_reason.to_json() if out.finished_reason else None,
            "e2e_latency": time.time() - h.created_time,
        }
        if out.first_token_time is not None:
            meta["ttft"] = out.first_token_time - h.created_time
        if out.spec_meta is not None:
            meta.update(out.spec_meta)  # spec_verify_ct, spec_accept_length, spec_accept_rate
        if h.return_logprob:
            meta.update(self._logprob_fields(out))
        return {"text": self.text(out), "output_ids": list(out.output_ids), "meta_info": meta}

    def text(self, out: ReqOutput) -> str:
        """The output text: a finished request's with its stop token or string trimmed (unless no_stop_trim), a
        running one's without a trailing partial character or the start of a stop string it may still complete."""
        if self._decode is None:
            return ""
        sp = out.header.sampling_params
        ids, reason = out.output_ids, out.finished_reason
        kwargs = {
            "skip_special_tokens": sp.skip_special_tokens,
            "spaces_between_special_tokens": sp.spaces_between_special_tokens,
        }
        if reason is None:
            text = self._streamed_text(out, kwargs)
            return text[: len(text) - sp.stops.hold_back(text)] if sp.stops is not None else text
        if reason.type == "stop" and isinstance(reason.matched, int) and not sp.no_stop_trim:
            ids = ids[:-1]
        text = self._decode(ids, **kwargs)
        if reason.type == "stop" and not sp.no_stop_trim:
            text = text[: len(text) - reason.cut]
        return text

    def _streamed_text(self, out: ReqOutput, kwargs: dict[str, Any]) -> str:
        """The output so far without a trailing partial multi-byte character."""
        if self._incremental:
            out.decode_window = out.decode_window or DecodeWindow()
            text = out.decode_window.advance(out.output_ids, self._decode, **kwargs)
            if text is not None:
                return text
        return self._decode(out.output_ids, **kwargs).rstrip("\ufffd")

    def _logprob_fields(self, out: ReqOutput) -> dict[str, Any]:
        h = out.header

        def token_text(tok: int) -> str | None:
            return self._token_text(tok) if h.return_text_in_logprobs else None

        def triples(pairs) -> list:
            return [[lp, tok, token_text(tok)] for lp, tok in pairs]

        def tops(rows) -> list:
            return [None if row is None else [[lp, tok, token_text(tok)] for lp, tok in row] for row in rows]

        fields = {
            "input_token_logprobs": triples(h.input_token_logprobs),
            "output_token_logprobs": triples(out.output_token_logprobs),
            "input_top_logprobs": tops(h.input_top_logprobs),
            "output_top_logprobs": tops(out.output_top_logprobs),
        }
        if h.token_ids_logprob is not None:
            fields["input_token_ids_logprobs"] = tops(h.input_token_ids_logprobs)
            fields["output_token_ids_logprobs"] = tops(out.output_token_ids_logprobs)
        return fields

    def _token_text(self, tok: int) -> str:
        """One token's text, decoded once per token id: a streamed request with logprobs and text gets every input
        and output token's text again in each chunk (a 2K-token prompt: 2K decodes per chunk)."""
        text = self._token_texts.get(tok)
        if text is None:
            text = self._token_texts[tok] = self._decode([tok])
        return text
