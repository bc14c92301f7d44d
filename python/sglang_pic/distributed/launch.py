"""Start the follower ranks of a tensor-parallel model replica next to its rank 0, and stop them.

Rank 0 (the offline Engine's process, or the server's scheduler process) runs the scheduler; ranks 1..tp-1 are
spawned processes that only receive batches and run the model (tp_follower). A replica's ranks rendezvous at a
fresh loopback TCP address; with data parallelism each replica gets its own address and its own GPUs.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from sglang_pic.server_args import ServerArgs

FOLLOWER_STOP_S = 5.0


@dataclass
class ReplicaPlacement:
    """Where one model replica runs: its data-parallel rank and the rendezvous address of its TP ranks."""

    dp_rank: int = 0
    init_method: str = ""  # tcp://127.0.0.1:port; unused when tp_size is 1

    def gpu_id(self, tp_size: int, tp_rank: int) -> int:
        return self.dp_rank * tp_size + tp_rank


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join_replica(args: ServerArgs, placement: ReplicaPlacement, tp_rank: int) -> None:
    """Bind this process to its GPU and join its replica's tensor-parallel group; nothing at tp_size = dp_size = 1."""
    from sglang_pic.distributed.parallel_state import bind_device, init_tensor_parallel

    device = args.resolved_device()
    if args.tp_size > 1 or args.dp_size > 1:
        bind_device(device, placement.gpu_id(args.tp_size, tp_rank))
    if args.tp_size > 1:
        init_tensor_parallel(tp_rank, args.tp_size, placement.init_method, device)


def start_local_replica(args: ServerArgs, model_dir: str) -> list[BaseProcess]:
    """Spawn the followers of a tensor-parallel replica whose rank 0 is this process (the offline Engine's) and
    join their group; returns the followers."""
    import torch.multiprocessing

    placement = ReplicaPlacement(0, free_init_method())
    procs = tp_follower_processes(torch.multiprocessing.get_context("spawn"), args, model_dir, placement)
    for p in procs:
        p.start()
    try:
        join_replica(args, placement, 0)
    except BaseException:
        stop_followers(procs, timeout=0)
        raise
    return procs


def tp_follower_processes(
    ctx: BaseContext, args: ServerArgs, model_dir: str, placement: ReplicaPlacement
) -> list[BaseProcess]:
    """Ranks 1..tp_size-1 of a replica, not yet started (daemons: they never outlive the process that starts them)."""
    from sglang_pic.distributed.tp_follower import run_tp_follower

    return [
        ctx.Process(
            target=run_tp_follower,
            args=(args, model_dir, rank, placement),
            name=f"tp{rank}" if placement.dp_rank == 0 else f"dp{placement.dp_rank}-tp{rank}",
            daemon=True,
        )
        for rank in range(1, args.tp_size)
    ]


def stop_followers(procs: list[BaseProcess], timeout: float = FOLLOWER_STOP_S) -> None:
    """Wait for followers that were told to stop; terminate any that do not leave in time."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.terminate()
            p.join(timeout)
