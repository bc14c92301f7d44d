"""Host-memory copies of radix-tree nodes evicted from the device KV pool (the hierarchical cache).

When the tree evicts a node from the device, its keys and values of every layer move here and the node stays in
the tree; a later match copies them back into fresh device slots. Keys are stored unrotated, so a span's KV is the
same at every offset: a block comes back into any request without a position fix-up. Host slots are plain token
indices (no pages): each layer is a [size, Hkv, D] tensor, pinned on CUDA so the copies are DMA transfers.

A backup must not make the host wait for the GPU: eviction runs at admission, while the step in flight computes.
So the KV goes out by non-blocking copies into pinned staging with an event, and lands in its host slots (a scatter
on the host) once that event has passed: `settle`, called by every pool operation. Backups land oldest first, so a
slot freed while its backup was still out and then reused by a later backup ends up holding the later one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool
from sglang_pic.utils_tensor import record_event


def host_kv_buffers(pool: MHATokenToKVPool, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers, tokens, Hkv, D] in host memory, laid out like `pool`'s layers; pinned when the pool
    lives on CUDA, so copies to and from it are DMA transfers."""
    pin = torch.device(pool.device).type == "cuda"
    shape = (pool.layer_num, tokens, pool.head_num)
    return (
        torch.empty((*shape, pool.head_dim), dtype=pool.dtype, pin_memory=pin),
        torch.empty((*shape, pool.v_head_dim), dtype=pool.dtype, pin_memory=pin),
    )


@dataclass
class PendingBackup:
    host: torch.Tensor  # the host slots it lands in
    k: torch.Tensor  # [layers, n, Hkv, D] staging, filled by the stream up to `event`
    v: torch.Tensor
    event: torch.cuda.Event | None


class HostKVPool:
    def __init__(self, device_pool: MHATokenToKVPool, size: int) -> None:
        if size < 1:
            raise ValueError(f"the host KV pool needs at least one token, got {size}")
        self.device_pool = device_pool
        self.size = size
        self.k, self.v = host_kv_buffers(device_pool, size)
        self.pending: deque[PendingBackup] = deque()
        self.clear()

    @classmethod
    def for_budget(
        cls, device_pool: MHATokenToKVPool, device_tokens: int, ratio: float, size_gb: float
    ) -> HostKVPool:
        """`size_gb` GB of host memory when positive, else `ratio` times the device pool's tokens."""
        if size_gb > 0:
            tokens = int(size_gb * 2**30) // device_pool.bytes_per_token()
        else:
            tokens = int(ratio * device_tokens)
        return cls(device_pool, tokens)

    def clear(self) -> None:
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.num_free = self.size
        self.pending.clear()

    def available_size(self) -> int:
        return self.num_free

    def bytes(self) -> int:
        return self.size * self.device_pool.bytes_per_token()

    def backup(self, device_slots: torch.Tensor) -> torch.Tensor | None:
        """Start copying the KV in `device_slots` (every layer) into new host slots, returned at once; None when
        the host pool is short. The device slots may be reused right away: later kernels queue behind the copies."""
        n = device_slots.numel()
        if n > self.num_free:
            return None
        self.num_free -= n
        host = self.free_slots[self.num_free : self.num_free + n].clone()
        pool = self.device_pool
        src = device_slots.to(pool.device)
        k, v = host_kv_buffers(pool, n)
        for layer in range(pool.layer_num):
            k[layer].copy_(pool.k_buffer[layer][src], non_blocking=True)
            v[layer].copy_(pool.v_buffer[layer][src], non_blocking=True)
        self.pending.append(PendingBackup(host, k, v, record_event(torch.device(pool.device))))
        self.settle()
        return host

    def settle(self, wait: bool = False) -> None:
        """Scatter the backups whose copies have landed into their host slots, oldest first; all of them (waiting
        for their copies) with `wait`."""
        while self.pending:
            backup = self.pending[0]
            if backup.event is not None and not backup.event.query():
                if not wait:
                    return
                backup.event.synchronize()
            self.k[:, backup.host] = backup.k
            self.v[:, backup.host] = backup.v
            self.pending.popleft()

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy a backup into `device_slots` and give its host slots back. The rows are gathered into pinned
        staging first: a copy from pageable memory may wait for the stream."""
        self.settle(wait=True)
        pool = self.device_pool
        dst = device_slots.to(pool.device)
        k, v = host_kv_buffers(pool, host_slots.numel())
        torch.index_select(self.k, 1, host_slots, out=k)
        torch.index_select(self.v, 1, host_slots, out=v)
        for layer in range(pool.layer_num):
            pool.k_buffer[layer][dst] = k[layer].to(dst.device, non_blocking=True)
            pool.v_buffer[layer][dst] = v[layer].to(dst.device, non_blocking=True)
        self.free(host_slots)

    def free(self, host_slots: torch.Tensor) -> None:
        n = host_slots.numel()
        self.free_slots[self.num_free : self.num_free + n] = host_slots
        self.num_free += n
