"""From API inputs to scheduler requests (tokenize, segment, validate) and from finished requests to API outputs.

Shared by the offline Engine and the HTTP server so both speak exactly the same wire format.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch

from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.managers.segmenter import PromptSegmenter
from sglang_pic.radix_ext.segments import Segment, canonicalize, namespaces_before, segment_keys, tail_key
from sglang_pic.sampling.grammar import grammar_backend
from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_policy import DEFAULT_HEAD_TOKENS, SpanPolicy, anchor_tokens, check_settings
from sglang_pic.tokenizer import DecodeWindow, fast_decode, plain_backend


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, tokenizer, model_config) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer) if tokenizer is not None else None
        self._incremental = tokenizer is not None and plain_backend(tokenizer) is not None  # see DecodeWindow
        self._token_texts: dict[int, str] = {}  # see _token_text; at most one entry per vocabulary id
        self.model_config = model_config
        self.context_len = model_config.context_len
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.segmenter = PromptSegmenter(tokenizer, server_args, self.vocab_size)
        self._model_anchor = anchor_tokens("auto", tokenizer)  # rendered once: requests asking for auto reuse it
        self.span_policy = self._server_span_policy()

    # ---- input --------------------------------------------------------------------------------------------
    def build_requests(self, obj: GenerateReqInput) -> list[Req]:
        """Validate and tokenize every prompt; raise ValueError naming the first problem (nothing is queued)."""
        items = [obj.item(i) for i in range(obj.batch_size())]
        texts = [item["text"] for item in items if isinstance(item["text"], str)]
        # Batches are encoded together; a lone prompt is not (a batch call costs more than its few encodes).
        known = self.segmenter.encode_all(texts) if len(texts) > 1 and self.tokenizer is not None else None
        reqs = []
        for i, item in enumerate(items):
            try:
                reqs.extend(self._build_one(item, known))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if obj.is_batch else str(e)) from None
        return reqs

    def _check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar here, so a bad one is refused at the door with the reason."""
        if self.server_args.speculative_algorithm is not None:
            raise ValueError("constrained decoding is not supported with speculative decoding")
        if self.tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer; this engine runs with skip_tokenizer_init")
        grammar_backend(self.tokenizer, self.vocab_size).compile(*params.grammar())

    def _build_one(self, item: dict[str, Any], known: dict | None = None) -> list[Req]:
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
        reqs = []
        for k in range(params.n):
            rid = base_rid if params.n == 1 else f"{base_rid}-{k}"
            reqs.append(
                Req(
                    rid=rid,
                    segments=self._req_segments(segments),
                    sampling_params=params,
                    prompt_len=prompt_len,
                    return_logprob=bool(item["return_logprob"]),
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_n,
                    token_ids_logprob=token_ids,
                    eos_token_ids=self.eos_token_ids,
                    input_text=item["text"],
                    generator=self._generator(params.seed, k),
                    priority=priority,
                )
            )
        return reqs

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

    def span_segments(self, spans: list[str]) -> list[ReqSegment]:
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
            out.append(ReqSegment("span", list(tokens), key.extra_key, key_lead=anchor))
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
    def _generator(seed: int | None, k: int) -> torch.Generator | None:
        if seed is None:
            return None
        g = torch.Generator()
        g.manual_seed(seed + k)
        return g

    @staticmethod
    def _req_segments(segments) -> list[ReqSegment]:
        """A span with a head becomes a "head" segment, keyed like PDEP text on the structure before it, and the
        span's tail, read from the tree path of the whole anchored span (see managers/req.py)."""
        out, start = [], 0
        for seg, key, before in zip(segments, segment_keys(segments), namespaces_before(segments)):
            k, tokens = seg.head, seg.token_ids
            if k:
                out.append(ReqSegment("head", list(tokens[:k]), before, start=start))
            lead = key.token_ids[: len(key.token_ids) - len(tokens) + k]
            out.append(ReqSegment(seg.kind, list(tokens[k:]), key.extra_key, start=start + k, key_lead=lead))
            start += len(tokens)
        if out[-1].kind == "span":
            out.append(ReqSegment("pdep", [], tail_key(segments, ()).extra_key, start=start))
        return out

    # ---- output -------------------------------------------------------------------------------------------
    def output_text(self, req: Req) -> str:
        sp = req.sampling_params
        if self.tokenizer is None:
            return ""
        ids = req.output_ids
        reason = req.finished_reason
        kwargs = {
            "skip_special_tokens": sp.skip_special_tokens,
            "spaces_between_special_tokens": sp.spaces_between_special_tokens,
        }
        if reason is None:
            text = self._streamed_text(req, kwargs)
            return text[: len(text) - sp.stops.hold_back(text)] if sp.stops is not None else text
        if reason.type == "stop" and isinstance(reason.matched, int) and not sp.no_stop_trim:
            ids = ids[:-1]
        text = self._decode(ids, **kwargs)
        if reason.type == "stop" and not sp.no_stop_trim:
            text = text[: len(text) - reason.cut]
        return text

    def _streamed_text(self, req: Req, kwargs: dict[str, Any]) -> str:
        """The output so far without a trailing partial multi-byte character."""
        if self._incremental:
            req.decode_window = req.decode_window or DecodeWindow()
            text = req.decode_window.advance(req.output_ids, self._decode, **kwargs)
            if text is not None:
                return text
        return self._decode(req.output_ids, **kwargs).rstrip("\ufffd")

    def format_output(self, req: Req, return_text_in_logprobs: bool = False) -> dict[str, Any]:
        now = time.time()
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens(),
            "cached_prefix_tokens": req.cached_prefix_tokens,
            "cached_span_tokens": req.cached_span_tokens,
            "recomputed_span_tokens": req.recomputed_span_tokens,  # span heads it computed itself (span_policy.py)
            "finish_reason": req.finished_reason.to_json() if req.finished_reason else None,
            "e2e_latency": now - req.created_time,
        }
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.created_time
        if req.spec_stats is not None:
            meta.update(req.spec_stats.to_meta())  # spec_verify_ct, spec_accept_length, spec_accept_rate
        if req.return_logprob:
            meta.update(self._logprob_fields(req, return_text_in_logprobs))
        return {"text": self.output_text(req), "output_ids": list(req.output_ids), "meta_info": meta}

    def _logprob_fields(self, req: Req, with_text: bool) -> dict[str, Any]:
        def token_text(tok: int) -> str | None:
            return self._token_text(tok) if with_text else None

        def triples(pairs) -> list:
            return [[lp, tok, token_text(tok)] for lp, tok in pairs]

        def tops(rows) -> list:
            return [None if row is None else [[lp, tok, token_text(tok)] for lp, tok in row] for row in rows]

        fields = {
            "input_token_logprobs": triples(req.input_token_logprobs),
            "output_token_logprobs": triples(req.output_token_logprobs),
            "input_top_logprobs": tops(req.input_top_logprobs),
            "output_top_logprobs": tops(req.output_top_logprobs),
        }
        if req.token_ids_logprob is not None:
            fields["input_token_ids_logprobs"] = tops(req.input_token_ids_logprobs)
            fields["output_token_ids_logprobs"] = tops(req.output_token_ids_logprobs)
        return fields

    def _token_text(self, tok: int) -> str:
        """One token's text, decoded once per token id: a streamed request with logprobs and text gets every input
        and output token's text again in each chunk (a 2K-token prompt: 2K decodes per chunk)."""
        text = self._token_texts.get(tok)
        if text is None:
            text = self._token_texts[tok] = self._decode([tok])
        return text


def _all_ints(values: list) -> bool:
    """Whether every value is an int but not a bool; checked once per distinct type, not once per token."""
    return all(issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, values)))
