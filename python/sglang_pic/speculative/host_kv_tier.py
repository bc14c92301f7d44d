"""The host-memory tier: the full KV of requests whose verification streams it to the device layer by layer.

With `--vericache-full-kv host` a request's full KV moves to host memory after prefill (pinned on CUDA, so copies
are asynchronous DMA); the device keeps only its draft cache. Each request owns one buffer per tensor kind,
[layers, capacity, Hkv, D], so a layer's tokens are one contiguous block: verification stages it with a single
copy per request and layer.

`HostStreamingBackend` runs a forward (verification, or an observation for compressor scores) over that tier:
before layer l attends, layer l's full KV of every request is in a device staging buffer. A ring of `depth`
staging buffers (as many layers as --vericache-staging-gb holds, at least two) is filled on a copy stream as soon as
the backend is set up, and the copy of layer l+depth is issued right after layer l's attention is queued, so
transfers overlap compute: the next layers' within the forward, and with staggered rounds (vericache_worker) the
drafting of the next group of requests before it. On the CPU the "host" tier is a separate tensor pool and the
copies are plain, so the same path runs in tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sglang_pic.layers.attention_backend import AttentionBackend
from sglang_pic.mem_cache.host_pool import host_kv_buffers
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool
from sglang_pic.speculative.draft_cache import TokenTable
from sglang_pic.speculative.spec_stats import SpecStats


def staging_depth(tokens: int, layer_bytes: int, num_layers: int, budget_bytes: int) -> int:
    """Layers staged ahead for a forward over `tokens` host-tier tokens: what the budget holds, 2 to num_layers."""
    return max(2, min(num_layers, budget_bytes // max(tokens * layer_bytes, 1)))


@dataclass
class HostKV:
    """One request's full KV on the host: tokens [0, length) of every layer."""

    k: torch.Tensor  # [layers, capacity, Hkv, D]
    v: torch.Tensor  # [layers, capacity, Hkv, Dv]
    length: int = 0
    pending: torch.cuda.Event | None = None  # device-to-host copies still in flight

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def settle(self) -> None:
        """Wait for in-flight copies into the buffers before the CPU reads or replaces them."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None


class HostKVTier:
    def __init__(self, pool: MHATokenToKVPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        self.pin = device.type == "cuda"
        self.bytes_in_use = 0
        # Freed buffers, kept for the next requests: pinning fresh host memory runs at about 1 GB/s (H200 host),
        # so a 16K-token Llama-3-8B request would wait ~2 s for its buffers before its KV could move.
        self.spare: list[tuple[torch.Tensor, torch.Tensor]] = []

    def token_bytes(self, layers: int | None = None) -> int:
        """Bytes of one token's keys and values over `layers` layers (all by default)."""
        per_layer = self.pool.bytes_per_token() // self.pool.layer_num
        return per_layer * (self.pool.layer_num if layers is None else layers)

    def _buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest spare pair that holds `capacity` tokens, else a new one."""
        fitting = [i for i, (k, _) in enumerate(self.spare) if k.shape[1] >= capacity]
        if fitting:
            return self.spare.pop(min(fitting, key=lambda i: self.spare[i][0].shape[1]))
        return host_kv_buffers(self.pool, capacity)

    def alloc(self, capacity: int) -> HostKV:
        kv = HostKV(*self._buffers(max(capacity, 1)))
        self.bytes_in_use += kv.capacity * self.token_bytes()
        return kv

    def reserve(self, kv: HostKV, tokens: int) -> None:
        """Grow kv (doubling) so it holds `tokens` tokens."""
        if tokens <= kv.capacity:
            return
        kv.settle()
        k, v = self._buffers(max(tokens, 2 * kv.capacity))
        k[:, : kv.length] = kv.k[:, : kv.length]
        v[:, : kv.length] = kv.v[:, : kv.length]
        self.bytes_in_use += (k.shape[1] - kv.capacity) * self.token_bytes()
        self.spare.append((kv.k, kv.v))
        kv.k, kv.v = k, v

    def free(self, kv: HostKV) -> None:
        kv.settle()
        self.bytes_in_use -= kv.capacity * self.token_bytes()
        self.spare.append((kv.k, kv.v))
        kv.k = kv.v = torch.empty(0)
        kv.length = 0

    def append_from_device(self, kv: HostKV, slots: torch.Tensor) -> int:
        """Copy device-pool tokens `slots` after kv's current tokens (stream-ordered); returns bytes moved."""
        n = slots.numel()
        self.reserve(kv, kv.length + n)
        for layer in range(self.pool.layer_num):
            k_buf, v_buf = self.pool.get_kv_buffer(layer)
            kv.k[layer, kv.length : kv.length + n].copy_(k_buf[slots], non_blocking=self.pin)
            kv.v[layer, kv.length : kv.length + n].copy_(v_buf[slots], non_blocking=self.pin)
        if self.pin:
            kv.pending = torch.cuda.Event()
            kv.pending.record()
        kv.length += n
        return n * self.token_bytes()


class HostKVSource:
    """A KVSource over a host-tier request: kept tokens are copied into fresh device slots (whose pages it lists
    in `fresh_pages`, for the caller to own)."""

    def __init__(self, tier: HostKVTier, kv: HostKV, allocator, stats: SpecStats) -> None:
        self.tier = tier
        self.kv = kv
        self.allocator = allocator
        self.stats = stats
        self.num_tokens = kv.length
        self.num_layers = tier.pool.layer_num
        self.pool = tier.pool
        self.fresh_pages: set[int] = set()

    def rows_for(self, index: torch.Tensor) -> torch.Tensor:
        slots = self.allocator.alloc(index.shape[1])
        assert slots is not None, "build slots were ensured free"
        self.fresh_pages.update(torch.unique(slots.cpu() // self.allocator.page_size).tolist())
        for layer in range(self.num_layers):
            k, v = self.read(layer, index[layer if index.shape[0] > 1 else 0])
            self.pool.set_kv_buffer(layer, slots, k, v)
        return slots[None]

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv.settle()
        idx = index.cpu()
        self.stats.h2d_bytes += idx.numel() * self.tier.token_bytes(1)
        device = self.tier.device
        return self.kv.k[layer, idx].to(device), self.kv.v[layer, idx].to(device)


class CopyStream:
    """Host<->device copies on a side stream on CUDA (ordered by events); plain copies on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def after_compute(self) -> Iterator[None]:
        """Run the enclosed copies after all compute queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class StagingPool:
    """Stands in for the KV pool `pool` in a staged batch: layer l reads staging buffer l % depth, which holds KV
    in the pool's units (its per-layer scales)."""

    def __init__(self, buffers: list[tuple[torch.Tensor, torch.Tensor]], pool: MHATokenToKVPool) -> None:
        self.buffers = buffers
        self.pool = pool
        self.head_num, self.dtype = pool.head_num, pool.dtype
        self.k_scale, self.v_scale = pool.k_scale, pool.v_scale

    def to_storage(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.to_storage(layer_id, k, v)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers[layer_id % len(self.buffers)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.get_kv_buffer(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.get_kv_buffer(layer_id)[1]


class HostStreamingBackend(AttentionBackend):
    """Runs `inner` with each request's keys 0..old-1 staged from the host tier, one layer at a time. Layer l's
    attention waits for layer l's copies, so by the last layer compute is ordered after every copy into the
    staging buffers, which may then be freed; copies of other forwards (a staggered group's) keep running.

    Staging row 0 is a dummy. Request b occupies rows off_b .. off_b + seq_len_b - 1, key j at off_b + j; a new
    token at position p >= old_b is stored at its staging row (so later tokens of the batch see it), a new token
    at p < old_b (an observation of tokens already on the host) goes to the dummy row. New tokens' KV is also
    written to the batch's out_cache_loc in the device pool: verification makes those the draft's slots.
    """

    def __init__(
        self, inner: AttentionBackend, pool: MHATokenToKVPool, sources: list[HostKV], copier: CopyStream,
        stats: SpecStats, staging_bytes: int,
    ) -> None:
        self.inner = inner
        self.staging_bytes = staging_bytes
        self.pool = pool
        self.sources = sources
        self.copier = copier
        self.stats = stats
        self.layer_bytes = pool.bytes_per_token() // pool.layer_num

    def init_forward_metadata(self, forward_batch) -> None:
        fb = forward_batch
        device = fb.positions.device
        olds = [s.length for s in self.sources]
        offsets, total = [], 1
        for old, n in zip(olds, fb.seq_lens_cpu):
            offsets.append(total)
            total += max(old, n)
        p = self.pool
        self.depth = staging_depth(total, self.layer_bytes, p.layer_num, self.staging_bytes)
        self.buffers = [
            (
                torch.empty((total, p.head_num, p.head_dim), dtype=p.dtype, device=device),
                torch.empty((total, p.head_num, p.v_head_dim), dtype=p.dtype, device=device),
            )
            for _ in range(self.depth)
        ]
        for k_stage, v_stage in self.buffers:  # the dummy row backs padded reads: keep it finite
            k_stage[0].zero_()
            v_stage[0].zero_()
        width = max(max(olds, default=1), max(fb.seq_lens_cpu, default=1))
        table = torch.zeros((len(olds), width), dtype=torch.int64)
        loc = []
        for b, (off, old, n, count) in enumerate(zip(offsets, olds, fb.seq_lens_cpu, fb.extend_seq_lens_cpu)):
            table[b, : max(old, n)] = torch.arange(off, off + max(old, n))
            loc.extend(off + pos if pos >= old else 0 for pos in range(n - count, n))
        self.olds, self.offsets = olds, offsets
        # The staged batch runs on `inner`: naming this backend there would make a reference cycle, and the
        # staging buffers would stay until Python's cycle collector ran.
        self.staged = dataclasses.replace(
            fb,
            attn_backend=self.inner,
            token_to_kv_pool=StagingPool(self.buffers, p),
            req_to_token_pool=TokenTable(table.to(device)),
            req_pool_indices=torch.arange(len(olds), device=device),
            req_pool_indices_cpu=list(range(len(olds))),
            out_cache_loc=torch.tensor(loc, dtype=torch.int64, device=device),
            attn_metadata=None,
        )
        self.inner.init_forward_metadata(self.staged)
        self.events: list[torch.cuda.Event | None] = [None] * p.layer_num
        for layer in range(self.depth):
            self._prefetch(layer)

    def _prefetch(self, layer: int) -> None:
        if layer >= self.pool.layer_num:
            return
        k_stage, v_stage = self.buffers[layer % self.depth]
        with self.copier.after_compute():
            for src, off, old in zip(self.sources, self.offsets, self.olds):
                k_stage[off : off + old].copy_(src.k[layer, :old], non_blocking=True)
                v_stage[off : off + old].copy_(src.v[layer, :old], non_blocking=True)
            self.events[layer] = self.copier.record()
        self.stats.h2d_bytes += sum(self.olds) * self.layer_bytes

    def forward(self, q, k, v, layer, forward_batch) -> torch.Tensor:
        lid = layer.layer_id
        self.copier.wait(self.events[lid])
        out = self.inner.forward(q, k, v, layer, self.staged)
        self.pool.set_kv_buffer(
            lid, forward_batch.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
        )
        self._prefetch(lid + self.depth)
        return out
