"""Data-parallel span-adapter training over the processes of a torchrun launch (`torchrun --nproc-per-node N -m
sglang_pic.train_span_adapter ...`): each process answers and back-propagates its share of every step's prompts,
the gradients are summed over the processes, and all of them take the same optimizer step. So a run sees the
examples one process would see, and N GPUs train about N times the prompts in the minutes a device call lasts. In
one process every method is a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the GPU of this process on its host

    @classmethod
    def from_env(cls) -> Group:
        """torchrun's RANK, WORLD_SIZE and LOCAL_RANK (one process without them)."""
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))

    @property
    def leader(self) -> bool:
        """The process that logs and writes checkpoints and the adapter."""
        return self.rank == 0

    def join(self, device: torch.device) -> None:
        if self.size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def leave(self) -> None:
        """Wait for every process, then tear the group down. Gloo's worker threads let go of a collective's tensors a
        moment after its wait returns; a process that exits right after its last collective (every one but the
        leader, which still writes the adapter) can be finalizing Python when they do, and aborts (a two-process CPU
        run failed so about once in a hundred). The barrier's own tensors are not Python's."""
        if self.size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def share(self, items: list) -> list:
        """This process's items: every size-th from its rank on."""
        return items[self.rank:: self.size]

    def sum(self, values: Sequence[float], device: torch.device) -> list[float]:
        """Each value summed over the processes."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether any process says so: a decision every process takes at the same step."""
        return self.sum([float(flag)], device)[0] > 0

    def sum_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Every parameter's gradient becomes its sum over the processes (one all-reduce of them all)."""
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        start = 0
        for p, g in zip(params, grads):
            p.grad = flat[start: start + g.numel()].view_as(p).clone()
            start += g.numel()

    def broadcast(self, params: Sequence[torch.Tensor]) -> None:
        """The leader's values into every process's parameters (fresh LoRA factors are drawn at random per process)."""
        if self.size == 1:
            return
        for p in params:
            dist.broadcast(p.data, 0)
