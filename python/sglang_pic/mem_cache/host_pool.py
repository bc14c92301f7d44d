"""Host-memory copies of radix-tree nodes evicted from the device KV pool (the hierarchical cache).

When the tree evicts a node from the device, its keys and values of every layer move here and the node stays in
the tree; a later match copies them back into fresh device slots. Keys are stored unrotated, so a span's KV is the
same at every offset: a block comes back into any request without a position fix-up. Host slots are plain token
indices (no pages): each layer is a [size, Hkv, D] tensor, pinned on CUDA so the copies are DMA transfers.
"""

from __future__ import annotations

import torch

from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool


def host_kv_buffers(pool: MHATokenToKVPool, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers, tokens, Hkv, D] in host memory, laid out like `pool`'s layers; pinned when the pool
    lives on CUDA, so copies to and from it are DMA transfers."""
    pin = torch.device(pool.device).type == "cuda"
    shape = (pool.layer_num, tokens, pool.head_num)
    return (
        torch.empty((*shape, pool.head_dim), dtype=pool.dtype, pin_memory=pin),
        torch.empty((*shape, pool.v_head_dim), dtype=pool.dtype, pin_memory=pin),
    )


class HostKVPool:
    def __init__(self, device_pool: MHATokenToKVPool, size: int) -> None:
        if size < 1:
            raise ValueError(f"the host KV pool needs at least one token, got {size}")
        self.device_pool = device_pool
        self.size = size
        self.k, self.v = host_kv_buffers(device_pool, size)
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

    def available_size(self) -> int:
        return self.num_free

    def bytes(self) -> int:
        return self.size * self.device_pool.bytes_per_token()

    def backup(self, device_slots: torch.Tensor) -> torch.Tensor | None:
        """Copy the KV in `device_slots` (every layer) into new host slots; None when the host pool is short."""
        n = device_slots.numel()
        if n > self.num_free:
            return None
        self.num_free -= n
        host = self.free_slots[self.num_free : self.num_free + n].clone()
        src = device_slots.to(self.device_pool.device)
        for layer in range(self.device_pool.layer_num):
            self.k[layer, host] = self.device_pool.k_buffer[layer][src].cpu()
            self.v[layer, host] = self.device_pool.v_buffer[layer][src].cpu()
        return host

    def restore(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy a backup into `device_slots` and give its host slots back."""
        dst = device_slots.to(self.device_pool.device)
        for layer in range(self.device_pool.layer_num):
            self.device_pool.k_buffer[layer][dst] = self.k[layer, host_slots].to(dst.device, non_blocking=True)
            self.device_pool.v_buffer[layer][dst] = self.v[layer, host_slots].to(dst.device, non_blocking=True)
        self.free(host_slots)

    def free(self, host_slots: torch.Tensor) -> None:
        n = host_slots.numel()
        self.free_slots[self.num_free : self.num_free + n] = host_slots
        self.num_free += n
