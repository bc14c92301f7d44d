"""What the scheduler's parts share: the request queues and the counters behind get_stats.

Admission (admission.py) moves requests from `waiting` into steps and `running`; finishing (finishing.py) takes
them out of `running`; both add what the next `Scheduler.step` returns to `to_report`. They hold this one object,
so no part keeps a copy of a queue that could drift from the others'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_pic.managers.req import Req


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_prefill_tokens: int = 0
    cached_prefix_tokens: int = 0
    cached_span_tokens: int = 0
    span_segments: int = 0
    span_segment_hits: int = 0
    num_retractions: int = 0
    num_preemptions: int = 0  # running requests retracted for a waiting one of higher priority
    num_steps: int = 0
    prefill_step_s: float = 0.0  # wall time of steps that ran prefill tokens (mixed steps included)
    decode_step_s: float = 0.0  # wall time of decode-only steps
    num_decode_steps: int = 0
    jump_forward_tokens: int = 0  # output tokens a grammar forced, prefilled instead of decoded (jump-forward)
    shared_decode_steps: int = 0  # steps whose decodes read shared KV runs once (kernels/shared_decode.py)
    decode_keys_saved: int = 0  # key reads (per layer and kv head) those steps did not repeat


@dataclass
class RequestQueues:
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)  # requests past prefill, decoding
    chunked: Req | None = None  # a request whose prefill spans several steps
    # Running constrained requests with forced tokens appended (jump-forward): their next step is one extend.
    jumping: list[Req] = field(default_factory=list)
    # What the next step returns: requests that got tokens or finished, inside a forward's commit or outside one.
    to_report: list[Req] = field(default_factory=list)

    def take_reports(self) -> list[Req]:
        """The requests to report, each once (one step may commit two launched steps that share requests)."""
        reports = list(dict.fromkeys(self.to_report))
        self.to_report.clear()
        return reports

    def stop_jumping(self, req: Req) -> None:
        if req in self.jumping:
            self.jumping.remove(req)
