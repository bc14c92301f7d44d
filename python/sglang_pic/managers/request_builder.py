"""From API inputs to the scheduler's wire messages: validate, tokenize, cut into segments (TokenizedGenerateReq).

Used by the HTTP server's main process and by the offline Engine, so both accept and refuse exactly the same
requests; their outputs are formatted in managers/output_format.py. Here every route's prompt meets the context
limit (ContextOverflow), counted in the tokens the scheduler will place, spans and heads included.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from sglang_pic.managers.io_struct import (
    GenerateReqInput, TokenizedGenerateReq, TokenizedSegment, adapter_keyed, runs_span_adapter, wire_segments,
)
from sglang_pic.managers.segmenter import PromptSegmenter
from sglang_pic.managers.span_lexical import SpanWords, choose_lexical, selects_lexically
from sglang_pic.radix_ext.segments import Segment, canonicalize, segment_keys
from sglang_pic.sampling.grammar import grammar_backend
from sglang_pic.sampling.sampling_params import SamplingParams, check_at_least
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import MAX_SPAN_GROUPS, SpanPolicy, anchor_tokens, check_settings
from sglang_pic.tokenizer import fast_decode


class ContextOverflow(ValueError):
    """A prompt that, with the output limit its client gave, does not fit the model's context. It is refused at once
    (as vLLM does) rather than cut short at the context's end; each API names its own limit field (`message`).
    `max_new_tokens` None: the prompt alone leaves no room for a token, whatever the limit."""

    def __init__(self, context_len: int, prompt_tokens: int, max_new_tokens: int | None) -> None:
        super().__init__()
        self.context_len = context_len
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.request: int | None = None  # the prompt's index in a batch

    def message(self, limit_field: str) -> str:
        """The refusal, naming the limit as the route calls it (max_tokens, max_completion_tokens, ...)."""
        where = "" if self.request is None else f"request {self.request}: "
        if self.max_new_tokens is None:
            problem = f"the prompt has {self.prompt_tokens} tokens, which leaves no room for the completion"
            fix = "the prompt"
        else:
            total = self.prompt_tokens + self.max_new_tokens
            problem = (
                f"you requested {total} tokens ({self.prompt_tokens} in the prompt, {self.max_new_tokens} for the "
                "completion)"
            )
            fix = f"the prompt or {limit_field}"
        return (
            f"{where}This model's maximum context length is {self.context_len} tokens. However, {problem}. "
            f"Reduce {fix}."
        )

    def __str__(self) -> str:
        return self.message("max_new_tokens")


class RequestBuilder:
    """Builds the scheduler's wire messages (build, span_segments) and answers /tokenize and /detokenize."""

    def __init__(self, server_args: ServerArgs, tokenizer, model_config) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer) if tokenizer is not None else None
        self._span_words = None if tokenizer is None else SpanWords(
            lambda ids: self._decode(ids, skip_special_tokens=True))
        self.model_config = model_config
        self.context_len = model_config.context_len
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.segmenter = PromptSegmenter(tokenizer, server_args, self.vocab_size)
        self._model_anchor = anchor_tokens("auto", tokenizer)  # rendered once: requests asking for auto reuse it
        self.span_policy = self._server_span_policy()

    # ---- requests -----------------------------------------------------------------------------------------
    def build(self, obj: GenerateReqInput, default_max_new_tokens: int | None = None) -> list[TokenizedGenerateReq]:
        """Validate and tokenize every prompt (n copies of each); raise ValueError naming the first problem.
        `default_max_new_tokens`: the output limit of a prompt whose sampling params give none (None: SamplingParams'
        default), cut to the room its prompt leaves in the context."""
        self._check_request(obj)
        items = [obj.item(i) for i in range(obj.batch_size())]
        texts = [item["text"] for item in items if isinstance(item["text"], str)]
        # Batches are encoded together; a lone prompt is not (a batch call costs more than its few encodes).
        known = self.segmenter.encode_all(texts) if len(texts) > 1 and self.tokenizer is not None else None
        msgs = []
        for i, item in enumerate(items):
            try:
                msgs.extend(self._build_one(obj, item, known, default_max_new_tokens))
            except ContextOverflow as e:
                if obj.is_batch:
                    e.request = i
                raise
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if obj.is_batch else str(e)) from None
        if not msgs:
            raise ValueError("the batch is empty")
        rids = [m.rid for m in msgs]
        if len(set(rids)) != len(rids):
            raise ValueError("rid values must be unique within a request")
        return msgs

    def _check_request(self, obj: GenerateReqInput) -> None:
        """The fields that apply to every prompt of `obj`."""
        for name in ("stream", "return_text_in_logprobs"):
            if not isinstance(getattr(obj, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(obj, name)!r}")
        rid = obj.rid
        if rid is not None and not isinstance(rid, str):
            if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
                raise ValueError(f"rid must be a string or a list of strings, got {rid!r}")
        dp_rank, dp_size = obj.data_parallel_rank, self.server_args.dp_size
        if dp_rank is not None and (type(dp_rank) is not int or not 0 <= dp_rank < dp_size):
            raise ValueError(f"data_parallel_rank must be in [0, {dp_size}), got {dp_rank!r}")

    def _check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar here, so a bad one is refused at the door with the reason."""
        if self.server_args.speculative_algorithm is not None:
            raise ValueError("constrained decoding is not supported with speculative decoding")
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer; this engine runs with skip_tokenizer_init")
        grammar_backend(self.tokenizer, self.vocab_size).compile(*params.grammar())

    def _build_one(
        self, obj: GenerateReqInput, item: dict[str, Any], known: dict | None, default_max_new_tokens: int | None
    ) -> list[TokenizedGenerateReq]:
        params = SamplingParams.from_dict(item["sampling_params"])
        params.verify(self.vocab_size)
        params.normalize(self.tokenizer)
        if params.grammar() is not None:
            self._check_grammar(params)
        if item["text"] is not None:
            if self.tokenizer is None:
                raise ValueError("text input needs a tokenizer; this engine runs with skip_tokenizer_init")
            if not isinstance(item["text"], str):
                raise ValueError("text must be a string")
            segments, own = self.segmenter.with_settings(item["text"], known)
        else:
            ids = item["input_ids"]
            if not isinstance(ids, list) or not _all_ints(ids):
                raise ValueError("input_ids must be a list of integers")
            segments, own = self.segmenter.from_ids(ids), {}
        policy = self._span_policy(item["span_settings"])
        segments = canonicalize(self._apply(policy, segments, own))
        groups = {seg.attention for seg in segments if seg.kind == "span"} - {(1.0, 1.0)}
        if len(groups) > MAX_SPAN_GROUPS:
            raise ValueError(f"the spans carry {len(groups)} distinct (span_attention_temperature, "
                             f"span_attention_scale) pairs; a request takes at most {MAX_SPAN_GROUPS}")
        prompt_len = sum(len(s.token_ids) for s in segments)  # the positions the scheduler gives the prompt
        given = isinstance(item["sampling_params"], dict) and item["sampling_params"].get("max_new_tokens") is not None
        self._fit_context(params, prompt_len, given, default_max_new_tokens)
        logprob_start_len = _count("logprob_start_len", item["logprob_start_len"], -1)
        top_n = _count("top_logprobs_num", item["top_logprobs_num"], 0)
        priority = self._priority(item["priority"])
        token_ids = self._token_ids_logprob(item["token_ids_logprob"], bool(item["return_logprob"]))
        if item["return_logprob"] and logprob_start_len >= 0:
            self._check_prompt_logprobs(segments, logprob_start_len)
        base_rid = item["rid"] or uuid.uuid4().hex
        adapter = runs_span_adapter(segments, self.server_args.span_adapter_apart())
        wire = wire_segments(segments, adapter)  # shared by the n copies: the scheduler copies what it grows
        probe = tuple(segments) if any(seg.query_share for seg in segments) else None
        return [
            TokenizedGenerateReq(
                rid=base_rid if params.n == 1 else f"{base_rid}-{k}",
                segments=wire,
                probe=probe,
                span_adapter=adapter,
                sampling_params=params,
                prompt_len=prompt_len,
                eos_token_ids=self.eos_token_ids,
                seed=None if params.seed is None else params.seed + k,
                return_logprob=bool(item["return_logprob"]),
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_n,
                token_ids_logprob=token_ids,
                priority=priority,
                data_parallel_rank=obj.data_parallel_rank,
                stream=obj.stream,
                return_text_in_logprobs=obj.return_text_in_logprobs,
            )
            for k in range(params.n)
        ]

    def _fit_context(self, params: SamplingParams, prompt_len: int, given: bool, default: int | None) -> None:
        """Refuse a prompt whose `given` output limit runs past the context, or that alone fills it (the scheduler
        would end it at the context's end); a default limit is cut to the room left instead, never refused."""
        room = self.context_len - prompt_len
        if room < 1 or (given and params.max_new_tokens > room):
            raise ContextOverflow(self.context_len, prompt_len, params.max_new_tokens if room > 0 else None)
        if not given:
            params.max_new_tokens = min(params.max_new_tokens if default is None else default, room)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[Segment]:
        """The segments /generate runs for `text`: cut at its markers, each tokenized on its own (BOS, when asked,
        on the prefix only), in canonical form."""
        if self.tokenizer is None:
            raise ValueError("tokenizing needs a tokenizer; this engine runs with skip_tokenizer_init")
        return canonicalize(self.segmenter.from_text(text, prefix_specials=add_special_tokens))

    def detokenize(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.tokenizer is None:
            raise ValueError("detokenizing needs a tokenizer; this engine runs with skip_tokenizer_init")
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    def span_segments(self, spans: list[str]) -> list[TokenizedSegment]:
        """Each span text as a request's span segment under the server's anchor, tokenized exactly as inside a
        marked prompt: what a span job computes for it (every head length reads the same tree path)."""
        out = []
        anchor = self.span_policy.anchor
        for i, text in enumerate(spans):
            if not isinstance(text, str) or not text:
                raise ValueError(f"span {i} must be a non-empty string")
            try:
                self.segmenter.check_markers(text)  # positions in the span's own text
            except ValueError as e:
                raise ValueError(f"span {i}: {e}") from None
            if self.segmenter.has_markers(text):
                raise ValueError(f"span {i} contains a span marker; markers are structure, not text")
            tokens = self.segmenter.from_text(self.server_args.ssep_marker + text)[-1].token_ids
            if len(anchor) + len(tokens) >= self.context_len:
                raise ValueError(
                    f"span {i} has {len(tokens)} tokens (behind a {len(anchor)}-token anchor), more than the context "
                    f"length allows ({self.context_len})"
                )
            key = segment_keys([Segment("span", tokens, anchor)])[0]
            out.append(TokenizedSegment("span", tokens, key.extra_key, key_lead=anchor))
        return adapter_keyed(out) if self.server_args.span_adapter_apart() else out  # only span prompts read spans

    # ---- span quality settings (span_policy.py) ----------------------------------------------------------------
    def _server_span_policy(self) -> SpanPolicy:
        args = self.server_args
        attention = (args.span_attention_temperature, args.span_attention_scale)
        if not args.spans_from_jobs():
            return SpanPolicy(attention=attention, select=args.span_select)
        head, tail, share = args.resolved_span_head_tokens(), args.span_tail_tokens, args.span_query_share
        if args.span_anchor == "prefix":
            return SpanPolicy((), head, anchor_is_prefix=True, tail_tokens=tail, query_share=share, attention=attention,
                              select=args.span_select)
        anchor = self._model_anchor if args.span_anchor == "auto" else anchor_tokens(args.span_anchor, self.tokenizer)
        return SpanPolicy(anchor, head, tail_tokens=tail, query_share=share, attention=attention,
                          select=args.span_select)

    def _span_policy(self, settings: Mapping[str, Any], base: SpanPolicy | None = None) -> SpanPolicy:
        """`base` (the server's settings) with the settings (span_policy.SPAN_FIELDS) a request or a span gives
        replaced."""
        base = self.span_policy if base is None else base
        given = {name: value for name, value in settings.items() if value is not None}
        if not given:
            return base
        check_settings(given)
        if self.server_args.disable_pic:  # no spans: nothing the settings would change
            return SpanPolicy()
        head = given.get("span_head_tokens", base.head_tokens)
        tail = given.get("span_tail_tokens", base.tail_tokens)
        share = given.get("span_query_share", base.query_share)
        attention = (float(given.get("span_attention_temperature", base.attention[0])),
                     float(given.get("span_attention_scale", base.attention[1])))
        if attention != (1.0, 1.0):
            self.server_args.check_span_attention()
        select = given.get("span_select", base.select)
        runs = given.get("span_recompute")
        runs = None if runs is None else tuple(tuple(run) for run in runs)
        anchor = given.get("span_anchor")
        if anchor is None:
            policy = SpanPolicy(base.anchor, head, base.anchor_is_prefix, tail, runs, share, attention, select)
        else:
            policy = SpanPolicy(self._model_anchor if anchor == "auto" else (), head, anchor == "prefix", tail, runs,
                                share, attention, select)
        if policy.from_job and not self.server_args.spans_from_jobs():
            raise ValueError(
                "span_anchor, span_head_tokens, span_tail_tokens and span_query_share need a server with the radix "
                "cache and page_size 1; this one serves isolated spans only (span_anchor none, 0 recomputed tokens)"
            )
        return policy

    def _apply(self, policy: SpanPolicy, segments: list[Segment], own: dict[int, dict]) -> list[Segment]:
        """Each span with its settings: its own (`own`, by segment index) over the request's `policy`; spans that
        select lexically have chosen (span_lexical.py)."""
        prefix = segments[0].token_ids if segments[0].kind == "prefix" else ()
        out = []
        for i, seg in enumerate(segments):
            if seg.kind == "span":
                try:
                    p = self._span_policy(own[i], policy) if i in own else policy
                except ValueError as e:
                    raise ValueError(f"span {sum(s.kind == 'span' for s in segments[:i])}: {e}") from None
                seg = Segment("span", seg.token_ids, p.anchor_for(prefix), p.recompute_runs(len(seg.token_ids)),
                              query_share=p.query_share, select=p.select, attention=p.attention)
            out.append(seg)
        if any(selects_lexically(seg) for seg in out):
            if self._span_words is None:
                raise ValueError("span_select lexical reads the prompt's words; this engine runs with "
                                 "skip_tokenizer_init")
            out = choose_lexical(out, self._span_words)
        return out

    @staticmethod
    def _check_prompt_logprobs(segments: list[Segment], logprob_start_len: int) -> None:
        """Prompt logprobs need their positions computed in the request's row, which a span from a job's tail (after
        its recomputed head) never is."""
        first, end = max(logprob_start_len - 1, 0), 0
        for seg in segments:
            end += len(seg.token_ids)
            if seg.kind == "span" and seg.from_job and end > first:
                raise ValueError(
                    f"prompt logprobs from logprob_start_len={logprob_start_len} cover a span served from a span "
                    "job; ask for them from after the last span, or send span_anchor none and span_head_tokens 0"
                )

    def _token_ids_logprob(self, ids: Any, return_logprob: bool) -> list[int] | None:
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not _all_ints(ids):
            raise ValueError(f"token_ids_logprob must be a non-empty list of token ids, got {ids!r}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob ids must be in [0, {self.vocab_size}), got {bad}")
        if not return_logprob:
            raise ValueError("token_ids_logprob needs return_logprob")
        return list(ids)

    def _priority(self, priority: Any) -> int | None:
        if priority is None:
            return None
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if not self.server_args.enable_priority_scheduling and self.server_args.abort_on_priority_when_disabled:
            raise ValueError("priority is set but priority scheduling is off (--enable-priority-scheduling)")
        return priority


def _count(name: str, value: Any, minimum: int) -> int:
    """An integer field (not a bool) of at least `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return check_at_least(name, value, minimum)


def _all_ints(values: list) -> bool:
    """Whether every value is an int but not a bool; checked once per distinct type, not once per token."""
    return all(issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, values)))
