"""The tensor-parallel group of this process, set once before the model is built, read by every parallel layer.

Two groups: model collectives run on `device_group` (NCCL on CUDA, gloo on CPU); the per-step batch broadcast runs
on `cpu_group` (gloo), where followers wait while the server is idle. Gloo notices a dead peer at once (the socket
closes), so its timeout only has to outlast idle periods and is set very long; NCCL does not, so whoever watches the
ranks' processes aborts the group when one dies (abort_tensor_parallel). The ranks meet through rendezvous.meet,
which gives up as soon as a peer process is gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sglang_pic.distributed.rendezvous import meet

IDLE_TIMEOUT = timedelta(days=3650)


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None


_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _GROUP


def bind_device(device: str, gpu_id: int) -> None:
    """Make `cuda` mean this process's GPU, so tensors created with device "cuda" land there."""
    if device == "cuda":
        torch.cuda.set_device(gpu_id)


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: str, check_peers: Callable[[], None]
) -> TensorParallelGroup:
    """Join the group of `size` ranks rendezvousing at `init_method` (tcp://host:port); a no-op for size 1.

    `check_peers` raises once a process this rank waits for is gone; it is called while the ranks gather.
    """
    global _GROUP
    if size == 1:
        _GROUP = TensorParallelGroup()
        return _GROUP
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; tensor parallelism owns it")
    store = meet(rank, size, init_method, check_peers, IDLE_TIMEOUT)
    if device == "cuda":
        # NVLink multicast (NVLS) stays off: it is not needed here and can take a shared host's GPUs out of service.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
        cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        _GROUP = TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
        _GROUP = TensorParallelGroup(rank, size, dist.group.WORLD, dist.group.WORLD)
    return _GROUP


def abort_tensor_parallel() -> None:
    """Make collectives that wait on a rank that died fail instead: NCCL would wait for it forever (gloo notices the
    closed connection by itself). Callable from any thread; the group is unusable afterwards."""
    if _GROUP.size > 1 and dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


def destroy_tensor_parallel() -> None:
    global _GROUP
    if _GROUP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if _GROUP.size > 1:
        dist.all_reduce(x, group=_GROUP.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim, in rank order."""
    if _GROUP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP.device_group)
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (e.g. KV pool sizes, which must agree)."""
    if _GROUP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_GROUP.cpu_group)
    return int(t.item())
