"""The order in which admission offers waiting requests room in a step: by priority first (with
--enable-priority-scheduling), then by the schedule policy: ISPS (isps.py), LPM (longest cached match first) or
FCFS."""

from __future__ import annotations

from sglang_pic.managers.isps import SpanPrefillPlanner
from sglang_pic.managers.req import Req
from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.server_args import ServerArgs


class WaitingOrder:
    def __init__(self, args: ServerArgs, tree: RadixCache, planner: SpanPrefillPlanner) -> None:
        self.policy = args.schedule_policy
        self.by_priority = args.enable_priority_scheduling
        self.low_values_first = args.schedule_low_priority_values_first
        self.tree = tree
        self.planner = planner

    def urgency(self, req: Req) -> int:
        """A request's priority as "larger is more urgent" (a request without one has priority 0)."""
        priority = req.priority or 0
        return -priority if self.low_values_first else priority

    def order(self, waiting: list[Req], step: int) -> list[Req]:
        """`waiting` in offer order; under ISPS the span jobs it creates for them join `waiting` (and the order)."""
        if self.policy == "isps":
            ordered, new_jobs = self.planner.order(waiting, step)
            waiting.extend(new_jobs)
        elif self.policy == "lpm" and len(waiting) > 1 and not self.tree.disable:
            ordered = sorted(waiting, key=lambda r: -self._matched(r))
        else:
            ordered = list(waiting)
        return self._by_urgency(waiting, ordered) if self.by_priority else ordered

    def _matched(self, req: Req) -> int:
        return sum(int(self.tree.match_prefix(s.key()).device_indices.numel()) for s in req.segments)

    def _by_urgency(self, waiting: list[Req], ordered: list[Req]) -> list[Req]:
        """`ordered` stably sorted by urgency; a span job is as urgent as the most urgent request waiting for it."""
        jobs: dict[str, int] = {}
        for req in waiting:
            urgency = self.urgency(req)
            for job in self.planner.blocked_on.get(req.rid, ()):
                jobs[job.rid] = max(jobs.get(job.rid, urgency), urgency)
        return sorted(ordered, key=lambda r: -jobs.get(r.rid, 0) if r.warmup else -self.urgency(r))
