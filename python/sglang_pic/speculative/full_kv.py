"""Where a request's full KV lives while it speculates, and how a round reserves, keeps and frees its slots.

`DeviceFullKV` (--vericache-full-kv gpu): the full KV stays in the scheduler's paged pool under the usual
ownership rules (managers/req_kv.py). A round allocates k+1 slots continuing the tail segment and writes them
into the request's row at positions L-1 .. L-1+k (L = seq_len): the drafted tokens use them as scratch and
verification then writes the real entries there. As tokens are committed the tail's `done`/`last_slot` advance
over the accepted ones; afterwards the pages holding only rejected slots are freed, so row, segment and
allocator agree exactly as after plain decoding. Drafts reference the request's own slots (no copies).

`HostFullKV` (--vericache-full-kv host): right after prefill the request's KV is copied to the host tier and
handed back to the scheduler (cached in the radix tree, then released, as a retraction would), so the scheduler
sees a running request without device KV. Its draft cache and the slots of each round belong to the worker
(tracked as pages on the draft); accepted tokens are appended to the host tier from their device slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_pic.speculative.draft_cache import DraftCache
from sglang_pic.speculative.host_kv_tier import CopyStream, HostKV, HostKVSource, HostKVTier, HostStreamingBackend
from sglang_pic.speculative.spec_stats import SpecStats

if TYPE_CHECKING:  # annotations only: requests and the scheduler's interface belong to the layer above
    from sglang_pic.managers.req import Req
    from sglang_pic.managers.spec_worker import SpecScheduler


def free_rejected(allocator, slots: torch.Tensor, kept: int) -> None:
    """Free the pages that hold only slots[kept:]; slots were allocated in order, so only slots[kept-1]'s page
    can mix kept and rejected slots, and it stays with its segment."""
    ps = allocator.page_size
    pages = set(torch.unique(slots[kept:].cpu() // ps).tolist()) - {int(slots[kept - 1]) // ps}
    if pages:
        allocator.free(torch.tensor(sorted(pages), dtype=torch.int64) * ps)


def slots_for_pages(n: int, last_slot: int, page_size: int) -> int:
    """Slots (whole pages) to have free for n more slots after `last_slot` (-1: start on a fresh page)."""
    head = 0 if last_slot < 0 else page_size - 1 - last_slot % page_size
    return (max(n - head, 0) + page_size - 1) // page_size * page_size


class DeviceKVSource:
    """A KVSource over a request's row in the device pool: drafts reference its slots."""

    def __init__(self, pool, row_slots: torch.Tensor) -> None:
        self.pool = pool
        self.slots = row_slots
        self.num_tokens = row_slots.numel()
        self.num_layers = pool.layer_num

    def rows_for(self, index: torch.Tensor) -> torch.Tensor:
        return self.slots[index]

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = self.pool.get_kv_buffer(layer)
        slots = self.slots[index]
        return k_buf[slots], v_buf[slots]


class DeviceFullKV:
    def __init__(self, host: SpecScheduler) -> None:
        runner = host.runner
        self.kv = host.kv
        self.pool = runner.token_to_kv_pool
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator

    def num_tokens(self, req: Req) -> int:
        return req.seq_len() - 1

    def row(self, req: Req) -> int:
        return req.req_pool_idx

    def _row_slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end]

    def adopt(self, req: Req) -> None:
        """Nothing to move: the request's KV stays where prefill wrote it."""

    def source(self, req: Req) -> DeviceKVSource:
        return DeviceKVSource(self.pool, self._row_slots(req, 0, self.num_tokens(req)).clone())

    def slots_for_build(self, num_rows: int) -> int:
        return 0

    def attach(self, old: DraftCache | None, new: DraftCache, source) -> None:
        """Drafts own no slots here."""

    def sync(self, req: Req, draft: DraftCache) -> None:
        """Append the tokens verified since the draft last looked (their slots are the request's own)."""
        n = self.num_tokens(req)
        if draft.covered < n:
            draft.append(self._row_slots(req, draft.covered, n))

    def slots_needed(self, req: Req, draft: DraftCache, n: int) -> int:
        return self.kv.slots_needed(req, [0] * (len(req.segments) - 1) + [n])

    def reserve(self, req: Req, draft: DraftCache, n: int) -> torch.Tensor:
        tail = req.tail
        slots = self.allocator.alloc(n, tail.last_slot)
        assert slots is not None, "round slots were ensured free"
        pos = tail.start + tail.done
        self.req_to_token_pool.write(req.req_pool_idx, slice(pos, pos + n), slots)
        return slots

    def wrap(self, reqs: list[Req], inner):
        return inner

    def keep(self, req: Req, slot: int) -> None:
        """The tail's next token (already in the request) now has KV in `slot`."""
        req.tail.done += 1
        req.tail.last_slot = slot
        req.tail.own.append(slot)

    def end_round(self, req: Req, draft: DraftCache, slots: torch.Tensor, kept: int, alive: bool) -> None:
        free_rejected(self.allocator, slots, kept)

    def release(self, req: Req, draft: DraftCache | None) -> None:
        """The scheduler frees the request's KV itself."""


class HostFullKV:
    def __init__(self, host: SpecScheduler, stats: SpecStats) -> None:
        runner = host.runner
        self.kv = host.kv
        self.pool = runner.token_to_kv_pool
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator
        self.page_size = self.allocator.page_size
        self.tier = HostKVTier(self.pool, runner.device)
        self.copier = CopyStream(runner.device)
        self.stats = stats
        self.staging_bytes = int(host.server_args.vericache_staging_gb * 2**30)
        self.host: dict[str, HostKV] = {}

    def num_tokens(self, req: Req) -> int:
        return self.host[req.rid].length

    def row(self, req: Req) -> int:
        return 0  # verification reads staged rows, not the request table

    def adopt(self, req: Req) -> None:
        """Copy the request's KV to the host tier, then give its device KV back to the scheduler."""
        n = req.seq_len() - 1
        # Room for every token it may still output, so the (pinned) buffer never has to grow.
        kv = self.tier.alloc(req.seq_len() + req.sampling_params.max_new_tokens - len(req.output_ids))
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n]
        self.stats.d2h_bytes += self.tier.append_from_device(kv, slots)
        self.host[req.rid] = kv
        self.kv.cache(req)
        self.kv.release(req)

    def source(self, req: Req) -> HostKVSource:
        return HostKVSource(self.tier, self.host[req.rid], self.allocator, self.stats)

    def slots_for_build(self, num_rows: int) -> int:
        return slots_for_pages(num_rows, -1, self.page_size)

    def attach(self, old: DraftCache | None, new: DraftCache, source: HostKVSource) -> None:
        """The new draft owns the pages its build copied into and what the old one owned; unused pages go back."""
        new.owned_pages = (old.owned_pages if old is not None else set()) | source.fresh_pages
        self._trim(new)

    def _trim(self, draft: DraftCache) -> None:
        referenced = draft.referenced_pages(self.page_size)
        unused = draft.owned_pages - referenced
        if unused:
            self.allocator.free(torch.tensor(sorted(unused), dtype=torch.int64) * self.page_size)
        draft.owned_pages &= referenced

    def sync(self, req: Req, draft: DraftCache) -> None:
        """Verified tokens were appended when they were accepted."""

    def slots_needed(self, req: Req, draft: DraftCache, n: int) -> int:
        return slots_for_pages(n, draft.last_slot, self.page_size)

    def reserve(self, req: Req, draft: DraftCache, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n, draft.last_slot)
        assert slots is not None, "round slots were ensured free"
        draft.owned_pages.update(torch.unique(slots.cpu() // self.page_size).tolist())
        return slots

    def wrap(self, reqs: list[Req], inner):
        return HostStreamingBackend(inner, self.pool, [self.host[r.rid] for r in reqs], self.copier, self.stats,
                                    self.staging_bytes)

    def keep(self, req: Req, slot: int) -> None:
        """Host-tier length and draft rows are updated once the round ends."""

    def end_round(self, req: Req, draft: DraftCache, slots: torch.Tensor, kept: int, alive: bool) -> None:
        if not alive:
            return  # finishing released everything the request held
        self.stats.d2h_bytes += self.tier.append_from_device(self.host[req.rid], slots[:kept])
        draft.append(slots[:kept])
        draft.last_slot = int(slots[kept - 1])
        self._trim(draft)

    def release(self, req: Req, draft: DraftCache | None) -> None:
        kv = self.host.pop(req.rid, None)
        if kv is not None:
            self.tier.free(kv)
        if draft is not None and draft.owned_pages:
            self.allocator.free(torch.tensor(sorted(draft.owned_pages), dtype=torch.int64) * self.page_size)
            draft.owned_pages = set()
