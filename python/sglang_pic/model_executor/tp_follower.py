"""Tensor-parallel follower processes: each loads its rank's shard, then runs every batch rank 0 sends until it stops.

Followers never schedule: their KV pool holds their own KV heads at the slot indices rank 0 chose. If rank 0 goes
away, gloo reports the closed connection and the follower exits. On its report pipe it says first that it runs,
then, if starting fails, why (see distributed/launch.py); the pipe is closed once it has started.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

import torch

from sglang_pic.distributed.launch import STARTED, Follower, ReplicaPlacement, join_replica
from sglang_pic.distributed.parallel_state import destroy_tensor_parallel
from sglang_pic.model_config import ModelConfig
from sglang_pic.model_executor.batch_broadcast import BatchReceiver, LoadWeights
from sglang_pic.model_executor.model_runner import ModelRunner
from sglang_pic.server_args import ServerArgs
from sglang_pic.utils_process import check_parent, prepare_child

logger = logging.getLogger(__name__)


def run_tp_follower(
    args: ServerArgs, model_dir: str, tp_rank: int, placement: ReplicaPlacement, report: Connection
) -> None:
    report.send(STARTED)
    parent_pid = prepare_child(args.log_level)
    if args.resolved_device() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))  # the ranks share the cores
    try:
        # The parent is rank 0 (offline Engine) or the server's main process, which stops every child when one dies.
        join_replica(args, placement, tp_rank, partial(check_parent, parent_pid))
        config = ModelConfig.from_server_args(model_dir, args)
        runner = ModelRunner(args, config)
        receiver = BatchReceiver(runner)
    except Exception as e:
        logger.error("tensor-parallel rank %d failed to start:\n%s", tp_rank, traceback.format_exc())
        report.send(f"{type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        report.close()
    try:
        while (msg := receiver.recv()) is not None:
            if isinstance(msg, LoadWeights):
                try:
                    runner.load_weights_on_all_ranks(msg.folder)
                except ValueError as e:  # rank 0 reports it; this rank has its previous weights back
                    logger.warning("tensor-parallel rank %d: %s", tp_rank, e)
            else:
                runner.forward_local(msg)
    except RuntimeError as e:  # rank 0 is gone (gloo: connection closed) or a collective failed
        logger.warning("tensor-parallel rank %d stops: %s", tp_rank, e)
        sys.exit(1)
    finally:
        destroy_tensor_parallel()


def tp_follower_processes(
    ctx: BaseContext, args: ServerArgs, model_dir: str, placement: ReplicaPlacement
) -> list[Follower]:
    """Ranks 1..tp_size-1 of a replica, not yet started (daemons: they never outlive the process that starts them)."""
    followers = []
    for rank in range(1, args.tp_size):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=run_tp_follower,
            args=(args, model_dir, rank, placement, writer),
            name=f"tp{rank}" if placement.dp_rank == 0 else f"dp{placement.dp_rank}-tp{rank}",
            daemon=True,
        )
        followers.append(Follower(rank, process, reader, writer))
    return followers
