"""Where the ranks of a tensor-parallel model replica run, how they join their group, and how followers stop.

Rank 0 (the offline Engine's process, or the server's scheduler process) runs the scheduler; ranks 1..tp-1 are
spawned processes that only receive batches and run the model (model_executor/tp_follower.py builds them). A
replica's ranks rendezvous at a fresh loopback TCP address; with data parallelism each replica gets its own address
and its own GPUs.

Each follower reports on a pipe that its code has started to run, and why it could not start if so, so that a
follower that died can be described: a spawned process re-imports the main module before it runs anything, which
fails when a script without an `if __name__ == "__main__":` guard starts the engine at import time.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from sglang_pic.server_args import ServerArgs
from sglang_pic.utils_process import exit_status

FOLLOWER_STOP_S = 5.0
STARTED = "started"  # a follower's first report; a second one is its start-up error


@dataclass
class ReplicaPlacement:
    """Where one model replica runs: its data-parallel rank and the rendezvous address of its TP ranks."""

    dp_rank: int = 0
    init_method: str = ""  # tcp://127.0.0.1:port; unused when tp_size is 1

    def gpu_id(self, tp_size: int, tp_rank: int) -> int:
        return self.dp_rank * tp_size + tp_rank


@dataclass
class Follower:
    """A follower process, not necessarily started, and the pipe it reports on (see the module docstring)."""

    rank: int
    process: BaseProcess
    report: Connection
    sender: Connection  # the follower's end of the pipe; closed here once the follower has it
    reports: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.process.start()
        self.sender.close()

    def exit_reason(self) -> str:
        """Why this follower, which has ended, is gone: for the error that names it."""
        self._read_reports()
        p = self.process
        who = f"tensor-parallel rank {self.rank} (process {p.name}, pid {p.pid})"
        status = exit_status(p.exitcode)
        if len(self.reports) > 1:
            return f"{who} failed to start ({status}): {self.reports[1]}"
        if self.reports:
            return f"{who} exited unexpectedly ({status})"
        if p.exitcode is not None and p.exitcode > 0:
            return f"{who} failed before running its own code ({status}): {_main_guard_hint()}"
        return f"{who} ended before it started ({status})"

    def close(self) -> None:
        self.report.close()
        self.sender.close()

    def _read_reports(self) -> None:
        try:
            while self.report.poll():
                self.reports.append(self.report.recv())
        except (EOFError, OSError):  # the follower is gone and everything it sent has been read
            pass


def _main_guard_hint() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    where = f"the main module ({main})" if main else "the main module"
    return (
        f"a spawned process first re-imports {where}, so a script that creates an Engine with tp_size > 1 must do "
        'so under `if __name__ == "__main__":`, or the import starts the engine again and fails (the follower\'s '
        "traceback is above)"
    )


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_replica(
    args: ServerArgs, placement: ReplicaPlacement, tp_rank: int, check_peers: Callable[[], None]
) -> None:
    """Bind this process to its GPU and join its replica's tensor-parallel group; nothing at tp_size = dp_size = 1.

    `check_peers` raises once a process the rendezvous waits for is gone, so that a dead rank ends the wait.
    """
    from sglang_pic.distributed.parallel_state import bind_device, init_tensor_parallel

    device = args.resolved_device()
    if args.tp_size > 1 or args.dp_size > 1:
        bind_device(device, placement.gpu_id(args.tp_size, tp_rank))
    if args.tp_size > 1:
        init_tensor_parallel(tp_rank, args.tp_size, placement.init_method, device, check_peers)


def stop_followers(followers: list[Follower], timeout: float = FOLLOWER_STOP_S) -> None:
    """Wait for followers that were told to stop; terminate any that do not leave in time."""
    for f in followers:
        p = f.process
        if p.pid is not None:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(timeout)
        f.close()
