"""The offline Engine's tensor-parallel replica: this process is rank 0 and spawns, watches and stops the others.

A follower that dies must become an error naming it, never a wait: the rendezvous polls the followers while it
waits, a watcher thread notices a death later on (and aborts an NCCL group, whose collectives would otherwise wait
for the dead rank forever), and the Engine asks `check()` before each step and `failure()` when a step fails.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import wait

from sglang_pic.distributed.launch import (
    FOLLOWER_STOP_S,
    Follower,
    ReplicaPlacement,
    free_init_method,
    join_replica,
    stop_followers,
)
from sglang_pic.distributed.parallel_state import abort_tensor_parallel, destroy_tensor_parallel
from sglang_pic.model_executor.tp_follower import tp_follower_processes
from sglang_pic.server_args import ServerArgs

logger = logging.getLogger(__name__)

EXIT_CODE_WAIT_S = 5.0


class LocalReplica:
    def __init__(self, followers: list[Follower]) -> None:
        self.followers = followers
        self._failure: str | None = None
        self._lock = threading.Lock()  # the watcher and the Engine's threads both read the reports
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="tp-follower-watcher", daemon=True)

    @classmethod
    def start(cls, args: ServerArgs, model_dir: str) -> "LocalReplica":
        """Spawn the followers and join their group; RuntimeError naming a follower that died meanwhile."""
        import torch.multiprocessing

        placement = ReplicaPlacement(0, free_init_method())
        replica = cls(tp_follower_processes(torch.multiprocessing.get_context("spawn"), args, model_dir, placement))
        try:
            for f in replica.followers:
                f.start()
            join_replica(args, placement, 0, replica.check)
        except BaseException:
            replica.stop(timeout=0)
            raise
        replica._watcher.start()
        return replica

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why a follower has ended, if one has, waiting up to `wait_s` for one to end (a collective can fail on a
        closed connection a moment before the dead process can be reaped)."""
        with self._lock:
            if self._failure is None:
                ended = wait([f.process.sentinel for f in self.followers], wait_s)
                dead = next((f for f in self.followers if f.process.sentinel in ended), None)
                if dead is not None:
                    dead.process.join(EXIT_CODE_WAIT_S)  # the sentinel closes a moment before the exit code is known
                    self._failure = dead.exit_reason()
            return self._failure

    def check(self) -> None:
        """Raise RuntimeError naming a follower that has ended: the replica cannot run without it."""
        failure = self.failure()
        if failure is not None:
            raise RuntimeError(failure)

    def stop(self, timeout: float = FOLLOWER_STOP_S) -> None:
        """Wait for the followers (told to stop, or dead), terminating any that stay, and leave the group."""
        self._stopping = True
        stop_followers(self.followers, timeout)
        destroy_tensor_parallel()

    def _watch(self) -> None:
        wait([f.process.sentinel for f in self.followers])
        if self._stopping:
            return
        failure = self.failure()
        logger.error("%s; the engine cannot generate any more", failure)
        abort_tensor_parallel()
