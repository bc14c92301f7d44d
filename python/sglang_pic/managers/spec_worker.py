"""What the scheduler asks of a speculative decoding worker, which decodes the running requests in rounds of its own.

The scheduler names no algorithm: whoever builds it (the Engine, the scheduler process) passes the factory of the
worker that --speculative-algorithm chose (speculative/algorithms.py), so the scheduler never imports one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from sglang_pic.managers.req import Req
from sglang_pic.speculative.spec_stats import SpecStats

if TYPE_CHECKING:
    from sglang_pic.managers.scheduler import Scheduler


class SpecWorker(Protocol):
    stats: SpecStats

    def decode_round(self) -> list[Req]:
        """Decode every running request by one round; the requests that got tokens (or finished)."""
        ...

    def release(self, req: Req) -> None:
        """The request leaves the running set (finish, abort, retraction): drop what the worker holds for it."""
        ...


# Called once with the scheduler being built, which the worker then drives its rounds through.
SpecWorkerFactory = Callable[["Scheduler"], SpecWorker]
