"""What the scheduler asks of a speculative decoding worker, which decodes the running requests in rounds of its own,
and what the worker may see and ask of the scheduler in turn (`SpecScheduler`), nothing more.

The scheduler names no algorithm: whoever builds it (the Engine, the scheduler process) passes the factory of the
worker that --speculative-algorithm chose (speculative/algorithms.py), so the scheduler never imports one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from sglang_pic.managers.req import Req
from sglang_pic.speculative.spec_stats import SpecStats

if TYPE_CHECKING:
    from sglang_pic.managers.admission import Admission
    from sglang_pic.managers.finishing import Finisher
    from sglang_pic.managers.req_kv import ReqKVManager
    from sglang_pic.managers.scheduler_state import RequestQueues
    from sglang_pic.model_executor.model_runner import ModelRunner
    from sglang_pic.sampling.logprobs import RowLogprobs
    from sglang_pic.sampling.penalty_counts import PenaltyCounts
    from sglang_pic.server_args import ServerArgs


class SpecWorker(Protocol):
    stats: SpecStats

    def decode_round(self) -> list[Req]:
        """Decode every running request by one round; the requests that got tokens (or finished)."""
        ...

    def release(self, req: Req) -> None:
        """The request leaves the running set (finish, abort, retraction): drop what the worker holds for it."""
        ...


class SpecScheduler(Protocol):
    """The scheduler as a speculative worker sees it: the running requests to decode (read-only), the KV they
    hold, and the three things a round asks of the scheduler."""

    server_args: ServerArgs
    runner: ModelRunner
    kv: ReqKVManager
    penalties: PenaltyCounts  # the engine's penalty counts, which drafts and verification sample under too
    context_len: int

    @property
    def running(self) -> Sequence[Req]: ...

    def retract_newest(self) -> None:
        """Make KV room as decoding does: the newest running request gives its KV back and waits again."""
        ...

    def commit_token(self, req: Req, tok: int, logprobs: RowLogprobs | None) -> bool:
        """Append a verified token (with its logprobs when the request returns them); whether the request
        finished, which also takes it out of the running set."""
        ...

    def count_round(self) -> None:
        """A round is a decode step for admission's reserve of decode tokens (its new-token ratio)."""
        ...


class SchedulerForSpec:
    """The scheduler's side of SpecScheduler: its parts, behind the narrow interface."""

    def __init__(
        self, server_args: ServerArgs, runner: ModelRunner, kv: ReqKVManager, queues: RequestQueues,
        admission: Admission, finishing: Finisher,
    ) -> None:
        self.server_args = server_args
        self.runner = runner
        self.kv = kv
        self.penalties = runner.sampler.penalties
        self.context_len = runner.model_config.context_len
        self._queues = queues
        self._admission = admission
        self._finishing = finishing

    @property
    def running(self) -> tuple[Req, ...]:
        return tuple(self._queues.running)

    def retract_newest(self) -> None:
        self._admission.retract_one()

    def commit_token(self, req: Req, tok: int, logprobs: RowLogprobs | None) -> bool:
        return self._finishing.commit_token(req, tok, logprobs)

    def count_round(self) -> None:
        self._admission.decay_new_token_ratio()


# Called once with the scheduler being built (as SpecScheduler), which the worker then drives its rounds through.
SpecWorkerFactory = Callable[[SpecScheduler], SpecWorker]
