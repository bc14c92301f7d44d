"""VeriCache: lossless speculative decoding where the model drafts over a compressed copy of its own KV.

One decode round for all running requests:
  1. drafts: a request fresh from prefill gets a draft cache from the compressor (after its KV moves to the host
     tier in host mode); drafts that grew too much since their last compression are compressed again;
  2. reserve: k+1 slots per request for the last committed token and k drafts (retract when memory is short);
  3. draft: k decode forwards of the same model over the draft caches, sampling each token from the draft
     distribution q; the drafted tokens' KV goes to the reserved slots as scratch;
  4. verify: one extend forward of [last token, d_1..d_k] over the full KV with normal causal attention, which
     overwrites the reserved slots with the real entries and gives the target distributions p_0..p_k. Its batch
     is set up before step 3 (the drafts are written into it afterwards), so a host-tier full KV starts copying
     to the device while the model drafts;
  5. accept: greedy or rejection sampling (spec_sampling.py) commits the accepted drafts and one more token;
     the full KV keeps exactly the accepted tokens' entries and frees the rest (full_kv.py).
Greedy output is token-identical to full-KV decoding (in float32; in bf16 as often as full-KV decoding agrees with
itself across batch shapes, since verification rounds like an extend) and sampled output has the same
distribution; compression only changes how many drafts are accepted.

Staggered rounds (vericache_stagger_groups > 1) split the requests into groups and pipeline steps 3-5 over them:
group i's verification is set up (its host-tier KV starts streaming to the device on the copy stream) and group
i drafts, then group i+1 is set up and drafts while those copies run, then group i verifies while group i+1's
copies run.
Drafting reads HBM, the transfers use PCIe, so each hides the other; every request still drafts and verifies once
per round, so outputs do not change.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sglang_pic.forward_batch import ForwardBatch, ForwardMode
from sglang_pic.sampling.logprobs import chosen_and_top_logprobs, compute_logprobs
from sglang_pic.sampling.penalty_counts import uses_history
from sglang_pic.speculative.attn_scores import ScoreCapture
from sglang_pic.speculative.compressor_base import create_compressor, refresh_threshold, resolve_budget
from sglang_pic.speculative.draft_cache import DraftBatch, DraftCache, TokenTable
from sglang_pic.speculative.draft_runner import DraftRunner
from sglang_pic.speculative.full_kv import DeviceFullKV, HostFullKV
from sglang_pic.speculative.spec_batches import Run, make_batch
from sglang_pic.speculative.spec_sampling import (
    accept_greedy,
    accept_sampled,
    distributions,
    draft_tokens,
    sampling_info,
)
from sglang_pic.speculative.spec_stats import ReqSpecStats, SpecStats
from sglang_pic.utils_tensor import upload

if TYPE_CHECKING:  # annotations only: requests and the scheduler's interface belong to the layer above
    from sglang_pic.managers.req import Req
    from sglang_pic.managers.spec_worker import SpecScheduler
    from sglang_pic.sampling.logprobs import RowLogprobs

DEFAULT_NUM_DRAFT_TOKENS = 16


class VeriCacheWorker:
    def __init__(self, host: SpecScheduler) -> None:
        """`host`: the scheduler, as far as a speculative worker may see it (managers/spec_worker.py)."""
        args = host.server_args
        self.host = host
        self.runner = host.runner
        self.device = self.runner.device
        self.num_draft = args.speculative_num_draft_tokens
        if self.num_draft is None:
            self.num_draft = DEFAULT_NUM_DRAFT_TOKENS
        if self.num_draft < 0:
            raise ValueError(f"speculative_num_draft_tokens must be >= 0, got {self.num_draft}")
        self.budget = args.vericache_budget
        resolve_budget(self.budget, 1)  # validates
        if args.vericache_full_kv not in ("gpu", "host"):
            raise ValueError(f"vericache_full_kv must be gpu or host, got {args.vericache_full_kv!r}")
        if args.tp_size > 1:
            raise NotImplementedError("vericache runs its own batches on one rank; tensor parallelism is unsupported")
        if args.enable_mixed_chunk:
            raise ValueError("vericache decodes in its own rounds; enable_mixed_chunk must be off")
        self.compressor = create_compressor(args.vericache_compressor)
        self.stats = SpecStats()
        self.full_kv = HostFullKV(host, self.stats) if args.vericache_full_kv == "host" else DeviceFullKV(host)
        self.drafts: dict[str, DraftCache] = {}
        self.vocab_size = self.runner.model_config.vocab_size
        self.penalties = host.penalties
        self.num_layers = self.runner.model_config.num_hidden_layers
        self.cuda = self.device.type == "cuda"
        self.stagger_groups = args.vericache_stagger_groups
        self.draft_runner = self._draft_runner()

    def _draft_runner(self) -> DraftRunner | None:
        """Static draft tables (and graphs over them on CUDA) when the compressor can draft over them with the
        engine's backend. They are as wide as a draft can get: the rows kept at the longest context, the tokens
        appended before the next compression, and the scratch slots of a round's drafts."""
        if not self.compressor.drafts_on_static_tables(self.runner.attn_backend):
            return None
        budget = resolve_budget(self.budget, self.host.context_len)
        rows = self.compressor.max_draft_tokens(self.host.context_len, budget)
        return DraftRunner(self.runner, rows + refresh_threshold(budget) + self.num_draft, self.compressor)

    # ---- scheduler hooks ------------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """The request leaves the running set (finish, abort, retraction): drop its draft and tier state."""
        self.full_kv.release(req, self.drafts.pop(req.rid, None))

    def decode_round(self) -> list[Req]:
        """Draft, verify and commit for every running request; return those that got tokens (or finished)."""
        self.host.count_round()
        start = self._now()
        self._prepare_drafts()
        self.stats.build_time_s += self._now() - start
        reqs, ks, slots = self._reserve()
        if not reqs:
            return []
        updated: list[Req] = []
        pending = None  # the group drafted last, its verification set up and its copies in flight
        for group in self._groups(len(reqs)):
            start = self._now()
            g_reqs, g_ks, g_slots = [reqs[b] for b in group], [ks[b] for b in group], [slots[b] for b in group]
            batch = self._prepare_verify(g_reqs, g_ks, g_slots)
            tokens, q = self._draft(g_reqs, g_ks, g_slots)
            self._place_drafts(batch, tokens, g_ks)
            mid = self._now()
            verify = (g_reqs, g_ks, g_slots, tokens, q, batch)
            if pending is not None:
                updated += self._verify_and_accept(*pending)
            pending = verify
            self.stats.draft_time_s += mid - start
            self.stats.verify_time_s += self._now() - mid
        start = self._now()
        updated += self._verify_and_accept(*pending)
        self.stats.verify_time_s += self._now() - start
        self.stats.rounds += 1
        return updated

    def _groups(self, n: int) -> list[list[int]]:
        """Request indices of each staggered group: contiguous, sizes differing by at most one."""
        count = min(self.stagger_groups, n)
        return [list(range(i * n // count, (i + 1) * n // count)) for i in range(count)]

    # ---- 1. drafts --------------------------------------------------------------------------------------------
    def _prepare_drafts(self) -> None:
        todo: list[tuple[Req, DraftCache | None]] = []
        for req in self.host.running:
            draft = self.drafts.get(req.rid)
            if draft is None:
                self.full_kv.adopt(req)
                todo.append((req, None))
                continue
            self.full_kv.sync(req, draft)
            if self.compressor.needs_refresh(draft, self._budget(req)):
                todo.append((req, draft))
        if not todo:
            return
        states = {req.rid: self.compressor.new_state() if d is None else d.state for req, d in todo}
        scores = self._observe([req for req, _ in todo], states)
        for req, old in todo:
            if req in self.host.running and self._ensure_build_slots(req):
                self._compress(req, old, states[req.rid], scores.get(req.rid))

    def _budget(self, req: Req) -> int:
        return resolve_budget(self.budget, self.full_kv.num_tokens(req))

    def _ensure_build_slots(self, req: Req) -> bool:
        """Free the slots a copying build needs, retracting newer requests (maybe this one) when short."""
        n = self.full_kv.num_tokens(req)
        need = self.full_kv.slots_for_build(self.compressor.max_draft_tokens(n, self._budget(req)))
        while req in self.host.running and not self.host.kv.ensure_free(need):
            self.host.retract_newest()
        return req in self.host.running

    def _compress(self, req: Req, old: DraftCache | None, state, scores: torch.Tensor | None) -> None:
        source = self.full_kv.source(req)
        budget = self._budget(req)
        if old is None:
            new = self.compressor.build(source, budget, scores, state, self.device)
        else:
            new = self.compressor.refresh(old, source, budget, scores, self.device)
        self.full_kv.attach(old, new, source)
        self.drafts[req.rid] = new
        self.stats.draft_builds += 1

    def _observe(self, reqs: list[Req], states: dict) -> dict[str, torch.Tensor]:
        """One observation forward re-running each request's last few tokens; their attention scores per key."""
        runs, observed = [], []
        for req in reqs:
            n = self.full_kv.num_tokens(req)
            w = self.compressor.observation(states[req.rid], n)
            if w <= 0:
                continue
            ids = req.all_ids()[n - w : n]
            runs.append(Run(self.full_kv.row(req), n - w, ids, attn_lo=_attn_lo(req, n - w, n), seq_len=n,
                            span_adapter=req.span_adapter))
            observed.append(req)
        if not runs:
            return {}
        capture = ScoreCapture(self.runner.attn_backend, self.num_layers)
        backend = self.full_kv.wrap(observed, capture)
        total = sum(len(r) for r in runs)
        loc = torch.zeros(total, dtype=torch.int64)  # the dummy slot: the tokens' KV is already stored
        batch = make_batch(self.runner, runs, loc, self.runner.req_to_token_pool, backend, logits=False)
        self.runner.forward_with(batch, None)
        return {req.rid: capture.scores[i] for i, req in enumerate(observed)}

    # ---- 2. reserve -------------------------------------------------------------------------------------------
    def _draft_len(self, req: Req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        room = self.host.context_len - req.seq_len()
        return max(0, min(self.num_draft, left, room))

    def _reserve(self) -> tuple[list[Req], list[int], list[torch.Tensor]]:
        """k+1 slots per running request; with memory short, draft nothing, then retract like plain decoding."""
        while self.host.running:
            reqs = list(self.host.running)
            ks = [self._draft_len(r) for r in reqs]
            need = sum(self.full_kv.slots_needed(r, self.drafts[r.rid], k + 1) for r, k in zip(reqs, ks))
            if self.host.kv.ensure_free(need):
                break
            need = sum(self.full_kv.slots_needed(r, self.drafts[r.rid], 1) for r in reqs)
            if self.host.kv.ensure_free(need):
                ks = [0] * len(reqs)
                break
            self.host.retract_newest()
        else:
            return [], [], []
        slots = [self.full_kv.reserve(r, self.drafts[r.rid], k + 1) for r, k in zip(reqs, ks)]
        return reqs, ks, slots

    # ---- 3. draft ---------------------------------------------------------------------------------------------
    def _draft(
        self, reqs: list[Req], ks: list[int], slots: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Drafted tokens [B, max k] (on the device) and, for sampled requests, the draft distributions q."""
        k_max = max(ks)
        tokens = torch.zeros((len(reqs), k_max), dtype=torch.int64, device=self.device)
        q: list[list[torch.Tensor]] = [[] for _ in reqs]
        if k_max == 0:
            return tokens, q
        batch = DraftBatch.build([self.drafts[r.rid] for r in reqs], [s[:k] for s, k in zip(slots, ks)], self.device)
        static = self.draft_runner
        if static is not None and static.tables.fits(batch):
            static.load(batch)
            table, backend, replayer = static.tables, static.backend, static.graph_runner
        else:
            backend = self.compressor.draft_backend(self.runner.attn_backend, batch, self.runner.token_to_kv_pool)
            table, replayer = TokenTable(batch.tables[0]), None
        current = upload([r.tail.tokens[-1] for r in reqs], device=self.device)
        for i in range(k_max):
            active = [b for b, k in enumerate(ks) if k > i]
            runs = []
            for b in active:
                n = batch.lengths[b] + i  # draft index of this step's input token
                runs.append(Run(b, batch.pos_offsets[b] + n, current[b : b + 1], seq_len=n + 1,
                                span_adapter=reqs[b].span_adapter))
            loc = torch.stack([slots[b][i] for b in active])
            fb = make_batch(self.runner, runs, loc, table, backend, logits=True, mode=ForwardMode.DECODE)
            logits = self.runner.forward_with(fb, replayer)[:, : self.vocab_size]
            history = self._histories(reqs, tokens, active, i)
            dist = distributions(logits, sampling_info(history, self.vocab_size, self.device, self.penalties))
            picked = draft_tokens(dist, [reqs[b].generator for b in active])
            index = upload(active, device=self.device)
            tokens[index, i] = picked
            current[index] = picked
            if dist.probs is not None:
                for row, b in enumerate(active):
                    if not dist.greedy[row]:
                        q[b].append(dist.probs[row])
        return tokens, q

    @staticmethod
    def _histories(reqs: list[Req], tokens: torch.Tensor, active: list[int], i: int) -> list[tuple[Req, list[int]]]:
        """Each active request with its first i drafted tokens (their values only when penalties look at them)."""
        needs = [b for b in active if uses_history(reqs[b])]
        values = tokens[needs, :i].tolist() if needs and i else []
        known = dict(zip(needs, values))
        return [(reqs[b], known.get(b, [0] * i)) for b in active]

    # ---- 4 + 5. verify and accept -----------------------------------------------------------------------------
    def _prepare_verify(self, reqs: list[Req], ks: list[int], slots: list[torch.Tensor]) -> ForwardBatch:
        """The verification batch of [last token, k drafts] per request, set up before drafting: its shape does not
        depend on the drafted tokens (placed into input_ids afterwards), so host-tier copies start here and run
        while the group drafts."""
        runs = [Run(self.full_kv.row(req), req.seq_len() - 1, [req.tail.tokens[-1]] + [0] * k,
                    span_adapter=req.span_adapter) for req, k in zip(reqs, ks)]
        backend = self.full_kv.wrap(reqs, self.runner.attn_backend)
        batch = make_batch(self.runner, runs, torch.cat(slots), self.runner.req_to_token_pool, backend, logits=True)
        backend.init_forward_metadata(batch)
        return batch

    def _place_drafts(self, batch: ForwardBatch, tokens: torch.Tensor, ks: list[int]) -> None:
        """Write the drafted tokens into the verification batch behind each request's last token (on the device,
        stream-ordered after drafting)."""
        src_b, src_i, dst, start = [], [], [], 0
        for b, k in enumerate(ks):
            src_b += [b] * k
            src_i += range(k)
            dst += range(start + 1, start + 1 + k)
            start += k + 1
        if dst:
            index = upload(src_b, src_i, dst, device=self.device).view(3, -1)
            batch.input_ids[index[2]] = tokens[index[0], index[1]]

    def _verify_and_accept(
        self, reqs: list[Req], ks: list[int], slots: list[torch.Tensor], tokens: torch.Tensor,
        q: list[list[torch.Tensor]], batch: ForwardBatch,
    ) -> list[Req]:
        logits = self.runner.forward_with(batch, None, prepared=True)[:, : self.vocab_size]
        self.stats.verify_batches += 1

        drafted = tokens.tolist()
        rows = [(req, drafted[b][:i]) for b, (req, k) in enumerate(zip(reqs, ks)) for i in range(k + 1)]
        dist = distributions(logits, sampling_info(rows, self.vocab_size, self.device, self.penalties))
        argmax = dist.argmax.tolist()
        logprobs = compute_logprobs(logits) if any(r.return_logprob for r in reqs) else None
        updated, start = [], 0
        for b, (req, k) in enumerate(zip(reqs, ks)):
            drafts = drafted[b][:k]
            if dist.greedy[start]:
                accepted, last = accept_greedy(drafts, argmax[start : start + k + 1])
            else:
                q_rows = torch.stack(q[b]) if k else None
                accepted, last = accept_sampled(drafts, q_rows, dist.probs[start : start + k + 1], req.generator)
            self._commit(req, slots[b], drafts[:accepted] + [last], accepted, logprobs, start)
            updated.append(req)
            start += k + 1
        return updated

    def _commit(
        self, req: Req, slots: torch.Tensor, toks: list[int], accepted: int, logprobs: torch.Tensor | None,
        start: int,
    ) -> None:
        """Output toks one by one, keeping KV for the last committed token and each accepted draft as it becomes
        part of the request; stop at a finish, then free what was not kept."""
        draft = self.drafts[req.rid]
        slot_ids = slots.tolist()
        self.full_kv.keep(req, slot_ids[0])
        kept, committed = 1, 0
        for i, tok in enumerate(toks):
            committed += 1
            if self.host.commit_token(req, tok, self._token_logprobs(req, tok, logprobs, start + i)):
                break
            if i < accepted:
                self.full_kv.keep(req, slot_ids[i + 1])
                kept += 1
        self.full_kv.end_round(req, draft, slots, kept, not req.finished())
        drafted = slots.numel() - 1
        req.spec_stats = req.spec_stats or ReqSpecStats()
        req.spec_stats.record(drafted, accepted, committed)
        self.stats.verify_ct += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_drafts += accepted
        self.stats.committed_tokens += committed

    @staticmethod
    def _token_logprobs(req: Req, tok: int, logprobs: torch.Tensor | None, row: int) -> RowLogprobs | None:
        """The logprobs the request returns for `tok`, from the log-softmax row that verified it."""
        if not req.return_logprob:
            return None
        return chosen_and_top_logprobs(logprobs[row][None], [tok], [req.top_logprobs_num], [req.token_ids_logprob])[0]

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _now(self) -> float:
        """Wall time once the compute stream is idle; host-tier copies in flight on the copy stream keep running."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()


def _attn_lo(req: Req, first: int, end: int) -> list[int]:
    """Lowest visible key of each position in [first, end), from the segment holding it."""
    out = []
    for seg in req.segments:
        lo, hi = max(first, seg.start), min(end, seg.start + len(seg.tokens))
        out.extend([seg.attn_lo] * max(hi - lo, 0))
    return out
