"""From API inputs to the scheduler's wire messages: validate, tokenize, cut into segments (TokenizedGenerateReq).

Used by the HTTP server's main process and by the offline Engine, so both accept and refuse exactly the same
requests; their outputs are formatted in managers/output_format.py.
"""

from __future__ import annotations

import uuid
from typing import Any

from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq, TokenizedSegment
from sglang_pic.managers.segmenter import PromptSegmenter
from sglang_pic.radix_ext.segments import Segment, canonicalize, namespaces_before, segment_keys, tail_key
from sglang_pic.sampling.grammar import grammar_backend
from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import DEFAULT_HEAD_TOKENS, SpanPolicy, anchor_tokens, check_settings
from sglang_pic.tokenizer import fast_decode


class RequestBuilder:
    """Builds the scheduler's wire messages (build, span_segments) and answers /tokenize and /detokenize."""

    def __init__(self, server_args: ServerArgs, tokenizer, model_config) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer) if tokenizer is not None else None
        self.model_config = model_config
        self.context_len = model_config.context_len
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.segmenter = PromptSegmenter(tokenizer, server_args, self.vocab_size)
        self._model_anchor = anchor_tokens("auto", tokenizer)  # rendered once: requests asking for auto reuse it
        self.span_policy = self._server_span_policy()

    # ---- requests -----------------------------------------------------------------------------------------
    def build(self, obj: GenerateReqInput) -> list[TokenizedGenerateReq]:
        """Validate and tokenize every prompt (n copies of each); raise ValueError naming the first problem."""
        self._check_request(obj)
        items = [obj.item(i) for i in range(obj.batch_size())]
        texts = [item["text"] for item in items if isinstance(item["text"], str)]
        # Batches are encoded together; a lone prompt is not (a batch call costs more than its few encodes).
        known = self.segmenter.encode_all(texts) if len(texts) > 1 and self.tokenizer is not None else None
        msgs = []
        for i, item in enumerate(items):
            try:
                msgs.extend(self._build_one(obj, item, known))
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

    def _build_one(self, obj: GenerateReqInput, item: dict[str, Any], known: dict | None) -> list[TokenizedGenerateReq]:
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
        policy = self._span_policy(item["span_anchor"], item["span_head_tokens"])
        segments = canonicalize(self._apply(policy, segments, own))
        prompt_len = sum(len(s.token_ids) for s in segments)
        if prompt_len >= self.context_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, more than the context length allows "
                f"({self.context_len} including at least one generated token)"
            )
        logprob_start_len = item["logprob_start_len"]
        top_n = item["top_logprobs_num"]
        if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool) or logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {logprob_start_len!r}")
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top_n!r}")
        priority = self._priority(item["priority"])
        token_ids = self._token_ids_logprob(item["token_ids_logprob"], bool(item["return_logprob"]))
        if item["return_logprob"] and logprob_start_len >= 0:
            self._check_prompt_logprobs(segments, logprob_start_len)
        base_rid = item["rid"] or uuid.uuid4().hex
        wire_segments = self._wire_segments(segments)  # shared by the n copies: the scheduler copies what it grows
        return [
            TokenizedGenerateReq(
                rid=base_rid if params.n == 1 else f"{base_rid}-{k}",
                segments=wire_segments,
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
        return out

    # ---- span quality settings (span_policy.py) ----------------------------------------------------------------
    def _server_span_policy(self) -> SpanPolicy:
        args = self.server_args
        if not args.spans_from_jobs():
            return SpanPolicy()
        head = DEFAULT_HEAD_TOKENS if args.span_head_tokens is None else args.span_head_tokens
        if args.span_anchor == "prefix":
            return SpanPolicy((), head, anchor_is_prefix=True)
        anchor = self._model_anchor if args.span_anchor == "auto" else anchor_tokens(args.span_anchor, self.tokenizer)
        return SpanPolicy(anchor, head)

    def _span_policy(self, anchor: Any, head: Any, base: SpanPolicy | None = None) -> SpanPolicy:
        """`base` (the server's settings) with the fields a request or a span gives replaced."""
        base = self.span_policy if base is None else base
        if anchor is None and head is None:
            return base
        check_settings(anchor, head)
        if self.server_args.disable_pic:  # no spans: nothing the settings would change
            return SpanPolicy()
        head = base.head_tokens if head is None else head
        if anchor is None:
            policy = SpanPolicy(base.anchor, head, base.anchor_is_prefix)
        else:
            policy = SpanPolicy(self._model_anchor if anchor == "auto" else (), head, anchor == "prefix")
        if policy.from_job and not self.server_args.spans_from_jobs():
            raise ValueError(
                "span_anchor and span_head_tokens need a server with the radix cache and page_size 1; "
                "this one serves isolated spans only (span_anchor none, span_head_tokens 0)"
            )
        return policy

    def _apply(self, policy: SpanPolicy, segments: list[Segment], own: dict[int, dict]) -> list[Segment]:
        """Each span with its settings: its own (`own`, by segment index) over the request's `policy`."""
        prefix = segments[0].token_ids if segments[0].kind == "prefix" else ()
        out = []
        for i, seg in enumerate(segments):
            if seg.kind == "span":
                try:
                    p = self._span_policy(own[i].get("span_anchor"), own[i].get("span_head_tokens"), policy) \
                        if i in own else policy
                except ValueError as e:
                    raise ValueError(f"span {sum(s.kind == 'span' for s in segments[:i])}: {e}") from None
                seg = Segment("span", seg.token_ids, p.anchor_for(prefix), p.head_tokens)
            out.append(seg)
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

    @staticmethod
    def _wire_segments(segments: list[Segment]) -> list[TokenizedSegment]:
        """A span with a head becomes a "head" segment, keyed like PDEP text on the structure before it, and the
        span's tail, read from the tree path of the whole anchored span (see managers/req.py)."""
        out, start = [], 0
        for seg, key, before in zip(segments, segment_keys(segments), namespaces_before(segments)):
            k, tokens = seg.head, seg.token_ids
            if k:
                out.append(TokenizedSegment("head", tokens[:k], before, start=start))
            lead = key.token_ids[: len(key.token_ids) - len(tokens) + k]
            out.append(TokenizedSegment(seg.kind, tokens[k:], key.extra_key, start=start + k, key_lead=lead))
            start += len(tokens)
        if out[-1].kind == "span":
            out.append(TokenizedSegment("pdep", (), tail_key(segments, ()).extra_key, start=start))
        return out


def _all_ints(values: list) -> bool:
    """Whether every value is an int but not a bool; checked once per distinct type, not once per token."""
    return all(issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, values)))
