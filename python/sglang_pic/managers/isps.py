"""Interleaved span-prefill scheduling (ISPS): the order in which queued prefill work is offered each step.

Requests whose spans are not cached do not compute those spans themselves (but see memory pressure below): each
such span becomes one span prefill job (a warm-up request holding only the span, at offset 0 — its KV is
position-free), shared by every request that needs it. Each step the scheduler fills its token budget, next to
the running decodes, in this order:
  1. work that has waited `max_wait_steps` or more (oldest first), so nothing starves;
  2. requests whose spans are all cached (only their own prefix/PDEP tokens left), first come first served: their
     extends are short and start decodes that then ride along with the span prefills still to come;
  3. span jobs, those that unblock waiting requests soonest first: waiting requests are ranked by the span tokens
     they still miss (fewest first) and their jobs are taken in that order, the jobs wanted by more requests first
     within one request. Ranking jobs by popularity alone leaves every request waiting for its rarest span until
     the last step, which is the barrier again whenever the span work outgrows one step's budget.
Under memory pressure (the spans staged for waiting requests, cached but unlocked until those requests run, do
not fit in the free and evictable KV memory) span jobs would evict staged spans before their requests run, to be
computed again, over and over. Then no new span job starts (aged ones and explicit warm-ups still do); instead the
blocked requests follow the ready ones, first come first served, and compute their missing spans themselves,
claimed so that a concurrent request needing the same span waits for it rather than computing it too. A span
from a job (anchored, or read after a recomputed head: see span_policy.py) cannot be computed by its request, so
the jobs such requests wait for are offered under pressure too.

A span job computes the span's whole key: behind an anchor, that is the plain text anchor + span (a prefix,
cached like any prompt's); the request reads only the span's slots.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.radix_ext.segments import SPAN_NAMESPACE
from sglang_pic.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglang_pic.managers.req_kv import ReqKVManager


def make_span_job(seg: ReqSegment, rid: str, arrival_step: int) -> Req:
    """A prefill-only request computing the whole span `seg` belongs to, behind the span's anchor (segments.py:
    an anchored span's key is the prefix anchor + span). Only requests that keep a span need spans, so the job runs
    under the span adapter whenever one is served apart from the weights."""
    extra_key, tokens = seg.span_id
    return Req(
        rid=rid,
        segments=[ReqSegment("span" if extra_key == SPAN_NAMESPACE else "prefix", list(tokens), extra_key)],
        span_adapter=True,
        sampling_params=SamplingParams(max_new_tokens=0),
        prompt_len=len(tokens),
        warmup=True,
        arrival_step=arrival_step,
        span_id=seg.span_id,
    )


class SpanPrefillPlanner:
    def __init__(self, kv: ReqKVManager, max_wait_steps: int) -> None:
        self.kv = kv
        self.max_wait_steps = max_wait_steps
        self.jobs: dict[tuple, Req] = {}  # span id -> its queued or running span job
        # span id -> rid of the request whose arrival created the job: that request computed the span (it is not
        # a cache hit for it), every other request that uses the span reused it.
        self.owner: dict[tuple, str] = {}
        # rid -> the span jobs a queued request still waits for ([] = none). Its spans are looked up in the tree
        # once, so a long queue costs no tree lookups per step; finished jobs just leave the list. A span evicted
        # after its job finished is computed by the request itself (claimed, so that others wait for it).
        self.blocked_on: dict[str, list[Req]] = {}
        self.held: dict[str, tuple[tuple, ...]] = {}  # rid -> the span ids of a waiting request
        # span id -> [waiting requests holding it, those of them blocked on its job, its tokens]: kept up to date as
        # requests come and go, so counting the staged spans walks distinct spans rather than requests.
        self._refs: dict[tuple, list[int]] = {}
        self.under_pressure = False  # set by order(): blocked requests compute their own spans this step
        self._next_id = 0

    def job_for(self, seg: ReqSegment, arrival_step: int) -> tuple[Req, bool]:
        """The span job computing `seg`, created if none exists yet; returns (job, created)."""
        sid = seg.span_id
        job = self.jobs.get(sid)
        if job is not None:
            return job, False
        self._next_id += 1
        job = make_span_job(seg, f"span-job-{self._next_id}", arrival_step)
        self.jobs[sid] = job
        return job, True

    def computed_for(self, req: Req) -> list[ReqSegment]:
        """The spans that jobs computed on `req`'s behalf (forgets them: asked once, at admission)."""
        self._block(req.rid, None)
        self._hold(req, None)
        return self._drop_owned(req)

    def forget(self, req: Req) -> None:
        """Drop `req`'s records (it left without being admitted; an aborted span job leaves the job table)."""
        self._block(req.rid, None)
        self._hold(req, None)
        if req.warmup:
            self.job_done(req)
        self._drop_owned(req)

    def _drop_owned(self, req: Req) -> list[ReqSegment]:
        """Remove and return `req`'s spans whose job its arrival created (a span it holds twice counts once)."""
        if not self.owner:  # no job is pending for anyone: no span's tokens need hashing
            return []
        owned, dropped = [], set()
        for seg in req.segments:
            if seg.kind == "span":
                sid = seg.span_id
                if self.owner.get(sid) == req.rid or sid in dropped:
                    self.owner.pop(sid, None)
                    dropped.add(sid)
                    owned.append(seg)
        return owned

    @staticmethod
    def _span_tokens(req: Req) -> dict[tuple, int]:
        """Span id -> the tokens `req` reads from it (all its pieces')."""
        out: dict[tuple, int] = defaultdict(int)
        for seg in req.segments:
            if seg.kind == "span":
                out[seg.span_id] += len(seg.tokens)
        return dict(out)

    def job_done(self, job: Req) -> None:
        if self.jobs.get(job.span_id) is job:
            del self.jobs[job.span_id]

    def order(self, waiting: list[Req], step: int) -> tuple[list[Req], list[Req]]:
        """Order `waiting` for admission; returns (ordered candidates, new span jobs to enqueue)."""
        new_jobs: list[Req] = []
        waiters: dict[str, int] = defaultdict(int)
        oldest: dict[str, int] = {}
        blocked: set[str] = set()
        needed: set[str] = set()  # jobs that a waiting request cannot do without, even under pressure
        for req in waiting:
            if req.warmup:
                continue
            jobs = self.blocked_on.get(req.rid)
            if jobs is not None and any(job.finished() for job in jobs):
                jobs = self._block(req.rid, [job for job in jobs if not job.finished()])
            if jobs is None:
                jobs = []
                for seg in self.kv.uncached_span_segments(req):
                    job, created = self.job_for(seg, req.arrival_step)
                    if created:
                        new_jobs.append(job)
                        self.owner[job.span_id] = req.rid
                    if job not in jobs:  # the pieces of one span share its job
                        jobs.append(job)
                self._hold(req, self._span_tokens(req))
                self._block(req.rid, jobs)
            if any(s.from_job for s in req.segments):
                needed.update(job.rid for job in jobs)
            for job in jobs:
                waiters[job.rid] += 1
                oldest[job.rid] = min(oldest.get(job.rid, req.arrival_step), req.arrival_step)
                blocked.add(req.rid)
        self.under_pressure = self._staged_tokens() > self.kv.available_size()
        if self.under_pressure:
            candidates = list(waiting) + new_jobs
        else:
            candidates = [r for r in waiting if r.warmup or r.rid not in blocked] + new_jobs
        rank = self._job_ranks(waiting, waiters)

        def age(r: Req) -> int:
            return step - oldest.get(r.rid, r.arrival_step)

        def key(r: Req) -> tuple:
            if age(r) >= self.max_wait_steps:
                return (0, -age(r), 0)
            if r.warmup:
                return (3, rank.get(r.rid, len(rank)), oldest.get(r.rid, r.arrival_step))
            return (2 if r.rid in blocked else 1, r.arrival_step, 0)

        def offered(r: Req) -> bool:
            withheld = self.under_pressure and r.warmup and waiters.get(r.rid) and r.rid not in needed
            return not withheld or age(r) >= self.max_wait_steps

        return sorted(filter(offered, candidates), key=key), new_jobs

    def _staged_tokens(self) -> int:
        """Tokens of the spans that some waiting request holds without waiting for their job: cached, and unlocked
        until that request runs."""
        return sum(tokens for holders, blocked, tokens in self._refs.values() if holders > blocked)

    def _hold(self, req: Req, sizes: dict[tuple, int] | None) -> None:
        """Record the spans (span id -> tokens) of a waiting request (None: it left the queue)."""
        for sid in self.held.pop(req.rid, ()):
            ref = self._refs[sid]
            ref[0] -= 1
            if ref[0] == 0:
                del self._refs[sid]
        if sizes is not None:
            self.held[req.rid] = tuple(sizes)
            for sid, n in sizes.items():
                self._refs.setdefault(sid, [0, 0, n])[0] += 1

    def _block(self, rid: str, jobs: list[Req] | None) -> list[Req] | None:
        """Set (None: forget) the jobs a waiting request waits for; returns `jobs`."""
        for job in self.blocked_on.pop(rid, ()):
            ref = self._refs.get(job.span_id)
            if ref is not None:
                ref[1] -= 1
        if jobs is not None:
            self.blocked_on[rid] = jobs
            for job in jobs:
                ref = self._refs.get(job.span_id)
                if ref is not None:
                    ref[1] += 1
        return jobs

    def _job_ranks(self, waiting: list[Req], waiters: dict[str, int]) -> dict[str, int]:
        """Span job rid -> its place in the order that completes waiting requests soonest."""
        blocked = []
        for place, req in enumerate(waiting):  # queue place breaks ties (rids are random: ties must not use them)
            jobs = self.blocked_on.get(req.rid)
            if jobs:  # order() has just dropped the finished ones
                blocked.append((sum(job.prompt_len for job in jobs), req.arrival_step, place, req.rid))
        rank: dict[str, int] = {}
        for *_, rid in sorted(blocked):
            for job in sorted(self.blocked_on[rid], key=lambda j: -waiters[j.rid]):
                rank.setdefault(job.rid, len(rank))
        return rank
