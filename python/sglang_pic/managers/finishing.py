"""Finishing: what a sampled token does to its request, and what leaves with a finished request.

A committed token is appended to the request's output (with its logprobs when it returns them), then the stops
are checked: stop tokens and EOS (after min_new_tokens), stop strings and regexes on the text of the newest tokens
decoded as the output will be, the length limits, and the output grammar, which must accept the token and ends
the request once it is complete. With jump-forward the tokens a grammar forces next are appended at once (their KV
comes in one extend, scheduled by admission.py). A finished request leaves `running`, and its KV goes to the tree
for later requests before its row is released.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sglang_pic.managers.isps import SpanPrefillPlanner
from sglang_pic.managers.overlap import LaunchedStep
from sglang_pic.managers.req import FinishReason, Req
from sglang_pic.managers.req_kv import ReqKVManager
from sglang_pic.managers.scheduler_state import RequestQueues, SchedulerStats
from sglang_pic.sampling.penalty_counts import uses_history
from sglang_pic.sampling.stop_conditions import SEARCH_TIMEOUT_S

if TYPE_CHECKING:
    from sglang_pic.sampling.logprobs import RowLogprobs

# Jump forward only over this many forced tokens or more: with overlap a jump also voids the request's row in the
# step already launched, so it costs two steps against one decode step per forced token.
JUMP_MIN_TOKENS = 2
# At most this many forced tokens per jump (the rest come with the next), so a jump's extend stays step-sized.
JUMP_MAX_TOKENS = 64


class Finisher:
    def __init__(
        self,
        queues: RequestQueues,
        kv: ReqKVManager,
        planner: SpanPrefillPlanner,
        stats: SchedulerStats,
        context_len: int,
        decode: Callable[..., str] | None,
        jump_forward: bool,
        leave: Callable[[Req], None],
    ) -> None:
        """`decode`: token ids -> text, for stop strings (None: no tokenizer, no text stops); `leave`: told of each
        request that leaves the running set."""
        self.queues = queues
        self.kv = kv
        self.planner = planner
        self.stats = stats
        self.context_len = context_len
        self.decode = decode
        self.jump_forward = jump_forward
        self.leave = leave

    def commit(self, step: LaunchedStep) -> None:
        """Append each sampled token of a launched step to its request and finish the request if it stops. Rows of
        requests that finished or were aborted since the launch, and void rows, are dropped. Finished requests
        leave `running` in one pass, so a step costs O(batch) however many finish in it."""
        for prompt in step.prompt_logprobs:
            prompt.record()
        out = step.out
        host = [c.get() for c in out.copies]
        next_ids = host[0].tolist()
        logprobs = dict(zip(out.logprob_rows, out.logprobs.by_row(host[1:]))) if out.logprobs is not None else {}
        reqs = step.reqs
        if out.void or any(r.finished_reason is not None for r in reqs):
            live = [i for i, r in enumerate(reqs) if r.finished_reason is None and i not in out.void]
            reqs, next_ids = [reqs[i] for i in live], [next_ids[i] for i in live]
            logprobs = {j: logprobs[i] for j, i in enumerate(live) if i in logprobs}
        finished = []
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            if req.sampling_params.max_new_tokens == 0:  # prefill-only call: the sampled token is not output
                req.finished_reason = FinishReason("length", matched=None)
            else:
                self._append(req, tok, logprobs.get(i))
            if req.finished_reason is not None:
                finished.append(req)
        self.queues.to_report += reqs
        if finished:
            gone = set(finished)
            running = self.queues.running
            running[:] = [r for r in running if r not in gone]
            for req in finished:
                self.release_finished(req)

    def commit_token(self, req: Req, tok: int, logprobs: RowLogprobs | None) -> bool:
        """Append one generated token to a running request; finish it (and drop it from `running`) if it stops.
        `logprobs`: the token's logprobs, when the request returns them. Returns whether the request finished."""
        if self._append(req, tok, logprobs):
            self.finish(req)
            return True
        return False

    def _append(self, req: Req, tok: int, logprobs: RowLogprobs | None) -> bool:
        """Record `tok` as the request's next output (its KV comes with the next forward); returns whether it stops."""
        if req.return_logprob:
            value, top, asked = logprobs
            req.output_token_logprobs.append((value, tok))
            if req.top_logprobs_num:
                req.output_top_logprobs.append(top)
            if req.token_ids_logprob is not None:
                req.output_token_ids_logprobs.append(asked)
        if req.first_token_time is None:
            req.first_token_time = time.time()
        req.append_output(tok)
        self.stats.generation_tokens += 1
        self._check_finished(req)
        if req.grammar is not None and req.finished_reason is None:
            if not req.grammar.accept_token(tok):  # only if a mask was not applied: never leave the grammar
                req.finished_reason = FinishReason("abort", message=f"token {tok} is outside the output's grammar")
            elif req.grammar.is_terminated():  # only stop tokens were allowed and one came (ignore_eos or not)
                req.finished_reason = FinishReason("stop", matched=tok)
            elif self.jump_forward and not req.return_logprob and not uses_history(req):
                self._jump_forward(req)
        return req.finished_reason is not None

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens `req`'s grammar forces next (at least JUMP_MIN_TOKENS): their KV comes in one extend,
        instead of a decode step each. They are outputs like sampled ones (stops and length apply)."""
        forced = req.grammar.find_jump_forward_tokens()[:JUMP_MAX_TOKENS]
        if len(forced) < JUMP_MIN_TOKENS:
            return
        for tok in forced:
            req.grammar.accept_token(tok)
            req.append_output(tok)
            self.stats.generation_tokens += 1
            self.stats.jump_forward_tokens += 1
            self._check_finished(req)
            if req.finished_reason is not None:
                return
        self.queues.jumping.append(req)

    def _check_finished(self, req: Req) -> None:
        sp = req.sampling_params
        tok = req.output_ids[-1]
        n = len(req.output_ids)
        if n >= sp.min_new_tokens:
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                req.finished_reason = FinishReason("stop", matched=tok)
                return
            if not sp.ignore_eos and tok in req.eos_token_ids:
                req.finished_reason = FinishReason("stop", matched=tok)
                return
            if sp.stops is not None and self.decode is not None:
                self._check_stop_text(req)
                if req.finished_reason is not None:
                    return
        if n >= sp.max_new_tokens or req.seq_len() >= self.context_len:
            req.finished_reason = FinishReason("length", matched=None)

    def _check_stop_text(self, req: Req) -> None:
        """End `req` at the earliest stop string or regex in the text of its newest tokens, decoded as its output
        will be, and record how much of that text the stop cuts off."""
        sp = req.sampling_params
        window = sp.stops.window
        whole = window is None or len(req.output_ids) <= window
        ids = req.output_ids if whole else req.output_ids[-window:]
        tail = self.decode(
            ids,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
        try:
            match = sp.stops.search(tail, 0 if whole else 1)
        except TimeoutError:
            message = f"stop_regex search took over {SEARCH_TIMEOUT_S} s (a pattern that backtracks too much)"
            req.finished_reason = FinishReason("abort", message=message)
            return
        if match is not None:
            req.finished_reason = FinishReason("stop", matched=match.stop, cut=len(tail) - match.start)

    def finish_span_job(self, job: Req) -> None:
        job.finished_reason = FinishReason("length", matched=None)
        self.planner.job_done(job)
        self.finish(job)

    def finish(self, req: Req) -> None:
        if req in self.queues.running:
            self.queues.running.remove(req)
        self.release_finished(req)

    def release_finished(self, req: Req) -> None:
        self.leave(req)
        # The last sampled token has no KV; everything before it is cached for later requests.
        self.kv.cache(req)
        self.kv.release(req)
