"""Interleaved span-prefill scheduling (ISPS): the order in which queued prefill work is offered each step.

Requests whose spans are not cached do not compute those spans themselves: each such span becomes one span
prefill job (a warm-up request holding only the span, at offset 0 — its KV is position-free), shared by every
request that needs it. Each step the scheduler fills its token budget, next to the running decodes, in this order:
  1. work that has waited `max_wait_steps` or more (oldest first), so nothing starves;
  2. span jobs, those that unblock the most waiting requests first;
  3. requests whose spans are all cached (only their own prefix/PDEP tokens left), first come first served.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglang_pic.mem_cache.req_kv import ReqKVManager


def _span_id(seg: ReqSegment) -> tuple:
    """What identifies a span's KV across requests: its namespace and tokens."""
    return (seg.extra_key, tuple(seg.tokens))


def make_span_job(extra_key: str | None, tokens: list[int], rid: str, arrival_step: int) -> Req:
    seg = ReqSegment("span", list(tokens), extra_key, start=0)
    return Req(
        rid=rid,
        segments=[seg],
        sampling_params=SamplingParams(max_new_tokens=0),
        prompt_len=len(tokens),
        warmup=True,
        arrival_step=arrival_step,
    )


class SpanPrefillPlanner:
    def __init__(self, kv: "ReqKVManager", max_wait_steps: int) -> None:
        self.kv = kv
        self.max_wait_steps = max_wait_steps
        self.jobs: dict[tuple, Req] = {}  # span id -> its queued or running span job
        # span id -> rid of the request whose arrival created the job: that request computed the span (it is not
        # a cache hit for it), every other request that uses the span reused it.
        self.owner: dict[tuple, str] = {}
        # rid -> the span jobs a queued request waits for ([] = all its spans were cached when last looked up).
        # Looked up again only when one of those jobs finishes or admission finds a span missing (evicted), so a
        # long queue costs no tree lookups per step.
        self.blocked_on: dict[str, list[Req]] = {}
        self._next_id = 0

    def job_for(self, seg: ReqSegment, arrival_step: int) -> tuple[Req, bool]:
        """The span job computing `seg`, created if none exists yet; returns (job, created)."""
        sid = _span_id(seg)
        job = self.jobs.get(sid)
        if job is not None:
            return job, False
        self._next_id += 1
        job = make_span_job(seg.extra_key, seg.tokens, f"span-job-{self._next_id}", arrival_step)
        self.jobs[sid] = job
        return job, True

    def recheck(self, req: Req) -> None:
        """Admission found one of `req`'s spans uncached after all: look its spans up again next step."""
        self.blocked_on.pop(req.rid, None)

    def computed_for(self, req: Req) -> list[ReqSegment]:
        """The spans that jobs computed on `req`'s behalf (forgets them: asked once, at admission)."""
        self.blocked_on.pop(req.rid, None)
        return self._drop_owned(req)

    def forget(self, req: Req) -> None:
        """Drop `req`'s records (it left without being admitted)."""
        self.blocked_on.pop(req.rid, None)
        self._drop_owned(req)

    def _drop_owned(self, req: Req) -> list[ReqSegment]:
        """Remove and return `req`'s spans whose job its arrival created (a span it holds twice counts once)."""
        if not self.owner:  # no job is pending for anyone: no span's tokens need hashing
            return []
        owned = []
        for seg in req.segments:
            if seg.kind == "span":
                sid = _span_id(seg)
                if self.owner.get(sid) == req.rid:
                    del self.owner[sid]
                    owned.append(seg)
        return owned

    def job_done(self, job: Req) -> None:
        self.jobs.pop(_span_id(job.segments[0]), None)

    def order(self, waiting: list[Req], step: int) -> tuple[list[Req], list[Req]]:
        """Order `waiting` for admission; returns (ordered candidates, new span jobs to enqueue)."""
        new_jobs: list[Req] = []
        waiters: dict[str, int] = defaultdict(int)
        oldest: dict[str, int] = {}
        blocked: set[str] = set()
        for req in waiting:
            if req.warmup:
                continue
            jobs = self.blocked_on.get(req.rid)
            if jobs is None or any(job.finished() for job in jobs):
                jobs = []
                for seg in self.kv.uncached_span_segments(req):
                    job, created = self.job_for(seg, req.arrival_step)
                    if created:
                        new_jobs.append(job)
                        self.owner[_span_id(seg)] = req.rid
                    jobs.append(job)
                self.blocked_on[req.rid] = jobs
            for job in jobs:
                waiters[job.rid] += 1
                oldest[job.rid] = min(oldest.get(job.rid, req.arrival_step), req.arrival_step)
                blocked.add(req.rid)
        candidates = [r for r in waiting if r.warmup or r.rid not in blocked] + new_jobs

        def age(r: Req) -> int:
            return step - oldest.get(r.rid, r.arrival_step)

        def key(r: Req) -> tuple:
            if age(r) >= self.max_wait_steps:
                return (0, -age(r), 0)
            if r.warmup:
                return (1, -waiters.get(r.rid, 0), oldest.get(r.rid, r.arrival_step))
            return (2, r.arrival_step, 0)

        return sorted(candidates, key=key), new_jobs
