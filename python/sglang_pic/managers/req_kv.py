"""Per-request KV bookkeeping between the request table, the slot allocator and the span-aware radix tree.

Ownership, per segment of a request (see managers/req.py):
  tokens [0, cached)     slots owned by the radix tree, locked through seg.lock_node
  tokens [cached, done)  slots owned by the request (freed by it, or handed to the tree by `cache`), listed on the
                         host in seg.own, so freeing them never reads the request's row back from the device
  tokens [done, len)     no KV yet
So at any moment: allocator free + tree-owned + request-owned slots == pool size.
A span tail (a segment with a `key_lead`) matches its whole span in the tree and takes the slots after the lead.
"""

from __future__ import annotations

from array import array

import torch

from sglang_pic.managers.req import Req, ReqSegment
from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.mem_cache.memory_pool import ReqToTokenPool
from sglang_pic.radix_ext.radix_cache import RadixCache
from sglang_pic.radix_ext.radix_tree import RadixKey
from sglang_pic.utils_tensor import to_device, upload

# A waiting request waits for a request in prefill that computes at least this many of its next prompt tokens.
SHARED_PREFIX_MIN = 32


class ReqKVManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, tree: RadixCache) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree = tree
        self.page_size = allocator.page_size
        self.disable_cache = tree.disable
        # Spans being computed right now: (extra_key, tokens) -> the request computing them. Others needing them
        # wait instead of recomputing.
        self.inflight_spans: dict[tuple, Req] = {}
        # Requests whose prompt is being computed right now (admitted, prefill not complete): rid -> request. A
        # request that would compute the same prefix or PDEP tokens (n > 1 samples, concurrent prompts sharing an
        # uncached system prompt or history) waits for them instead.
        self.inflight_prefixes: dict[str, Req] = {}

    # ---- capacity ---------------------------------------------------------------------------------------------
    def available_size(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def ensure_free(self, num_tokens: int) -> bool:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available_size() >= num_tokens

    def slots_needed(self, req: Req, counts: list[int]) -> int:
        """Slots (whole pages) needed to give `counts[i]` more tokens to segment i."""
        ps = self.page_size
        total = 0
        for seg, n in zip(req.segments, counts):
            if n <= 0:
                continue
            head = 0 if seg.last_slot < 0 else ps - 1 - seg.last_slot % ps
            total += (max(n - head, 0) + ps - 1) // ps * ps
        return total

    # ---- admission --------------------------------------------------------------------------------------------
    def match(self, req: Req) -> None:
        """Reuse cached KV for every segment; lock what was matched and write its slots into the request's row."""
        last_nonempty = max((i for i, s in enumerate(req.segments) if s.tokens), default=0)
        limit = req.reuse_limit()
        req.cached_prefix_tokens = req.cached_span_tokens = req.recomputed_span_tokens = 0
        for i, seg in enumerate(req.segments):
            cap = len(seg.tokens)
            if i == last_nonempty and not req.warmup:
                cap -= 1  # the last token is always computed: its logits give the next token
            if limit is not None:
                cap = min(cap, max(limit - seg.start, 0))
            n = 0
            if not self.disable_cache and cap > 0:
                result = self.tree.match_prefix(seg.key(cap))
                lead = len(seg.key_lead)
                n = max(int(result.device_indices.numel()) - lead, 0)
            req.recomputed_span_tokens += seg.span_tokens_from(n)
            if n == 0:
                continue
            self.req_to_token_pool.write(
                req.req_pool_idx, slice(seg.start, seg.start + n), result.device_indices[lead : lead + n]
            )
            self.tree.inc_lock_ref(result.last_node)
            # The tree holds whole pages, so the match ends one: the next token starts a fresh page.
            seg.lock_node, seg.cached, seg.done, seg.last_slot = result.last_node, n, n, -1
            assert not seg.own, "matched a segment that still owns slots"
            if seg.kind == "span":
                req.cached_span_tokens += n
            else:
                req.cached_prefix_tokens += n

    def _shareable_uncached_spans(self, req: Req) -> list[ReqSegment]:
        # Only whole pages are shared, so a span with less than a page left to compute is not worth waiting for;
        # nor is one whose prompt logprobs the request computes itself. A span from a job is never computed here.
        return [
            s for s in req.segments
            if s.kind == "span" and not s.from_job and len(s.tokens) - s.done >= self.page_size
            and req.reuses_whole(s)
        ]

    def uncached_span_segments(self, req: Req) -> list[ReqSegment]:
        """Spans of a queued request that a span job should compute (looked up without locking): those with whole
        pages left to compute, and every span from a job that is not whole in the tree."""
        if self.disable_cache:
            return []
        out = []
        for seg in req.segments:
            if seg.kind == "span" and (seg.from_job or len(seg.tokens) >= self.page_size and req.reuses_whole(seg)):
                hit = int(self.tree.match_prefix(seg.key()).device_indices.numel())
                missing = len(seg.key_lead) + len(seg.tokens) - hit
                if missing >= self.page_size or seg.from_job and missing > 0:
                    out.append(seg)
        return out

    def job_slots_needed(self, missing: list[ReqSegment]) -> int:
        """Slots the span jobs of a request's `missing` spans (missing_job_spans) would take: each span's whole key
        (anchor, recomputed head and all, as its job computes it) less what the tree holds of it."""
        total = 0
        for extra_key, tokens in dict.fromkeys(s.span_id for s in missing):  # lookups refresh the tree's LRU times
            hit = int(self.tree.match_prefix(RadixKey(tokens, extra_key)).device_indices.numel())
            total += (len(tokens) - hit + self.page_size - 1) // self.page_size * self.page_size
        return total

    @staticmethod
    def missing_job_spans(req: Req) -> list[ReqSegment]:
        """A matched request's spans from a job that the tree does not hold whole: it cannot run before their jobs."""
        return [s for s in req.segments if s.from_job and s.done < len(s.tokens)]

    def inflight_owner(self, req: Req) -> Req | None:
        """The request in prefill that is computing KV `req` would compute too, for `req` to wait on (it then finds
        that KV in the tree); None: `req` computes its own. Only requests in prefill are named here, and they run
        each step until their prefill is launched, so a request never waits on nothing."""
        if self.inflight_spans:
            for seg in self._shareable_uncached_spans(req):
                owner = self.inflight_spans.get(seg.span_id)
                if owner is not None and owner is not req:
                    return owner
        return self._inflight_prefix_owner(req)

    def _inflight_prefix_owner(self, req: Req) -> Req | None:
        """A request in prefill computing the next SHARED_PREFIX_MIN tokens of one of `req`'s prefix or PDEP
        segments (after what `req` matched): same namespace, same place, same tokens, so the same KV."""
        computing = [(other, s) for other in self.inflight_prefixes.values() if other is not req
                     for s in self._prompt_segments(other)]
        if not computing:
            return None
        tail = next((s for s in reversed(req.segments) if s.tokens), None)
        for seg in self._prompt_segments(req):
            lo = seg.done
            hi = lo + max(SHARED_PREFIX_MIN, self.page_size)
            if hi > len(seg.tokens) - (seg is tail):  # the prompt's last token is computed by req itself
                continue
            want = seg.tokens[lo:hi]
            for other, o in computing:
                if o.extra_key == seg.extra_key and o.start == seg.start and o.tokens[lo:hi] == want:
                    return other
        return None

    @staticmethod
    def _prompt_segments(req: Req) -> list[ReqSegment]:
        """The segments whose KV depends on the prompt before them, where `req` may reuse all of it."""
        if req.warmup:
            return []
        return [s for s in req.segments if s.kind != "span" and req.reuses_whole(s)]

    def claim(self, req: Req) -> None:
        """Mark the spans and the prompt prefix that `req`, just admitted, computes as in flight."""
        if self.disable_cache:
            return
        for s in self._shareable_uncached_spans(req):
            self.inflight_spans.setdefault(s.span_id, req)
        if any(len(s.tokens) - s.done > SHARED_PREFIX_MIN for s in self._prompt_segments(req)):
            self.inflight_prefixes[req.rid] = req

    def prefill_done(self, req: Req) -> None:
        """`req`'s prefill is launched to its end: its prompt and spans are no longer being computed (a request
        waiting for them finds in the tree what `req` inserted, and computes the rest itself)."""
        self.inflight_prefixes.pop(req.rid, None)
        for seg in req.segments:
            if seg.kind == "span":
                self._unclaim(req, seg)

    def _unclaim(self, req: Req, seg: ReqSegment) -> None:
        if not self.inflight_spans:  # the usual case, and it saves hashing the span's tokens
            return
        if self.inflight_spans.get(seg.span_id) is req:
            del self.inflight_spans[seg.span_id]

    # ---- allocation -------------------------------------------------------------------------------------------
    def alloc(self, req: Req, counts: list[int]) -> torch.Tensor | None:
        """Allocate slots for the next counts[i] tokens of each segment (in logical order) and record them."""
        if not self.ensure_free(self.slots_needed(req, counts)):
            return None
        parts, firsts = [], []
        for seg, n in zip(req.segments, counts):
            if n <= 0:
                continue
            slots = self.allocator.alloc_host(n, seg.last_slot)
            assert slots is not None
            firsts.append(seg.start + seg.done)
            seg.done += n
            seg.last_slot = int(slots[-1])  # read on the host: no device sync
            seg.own.frombytes(slots.numpy().tobytes())
            parts.append(slots)
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        out = to_device(parts[0] if len(parts) == 1 else torch.cat(parts), self.allocator.device)
        offset = 0
        for first, part in zip(firsts, parts):
            n = part.numel()
            self.req_to_token_pool.write(req.req_pool_idx, slice(first, first + n), out[offset : offset + n])
            offset += n
        return out

    def _fresh_pages(self, reqs: list[Req]) -> list[bool]:
        """Whether each request's tail page is full (or it has none yet): its next token starts a fresh page.
        One list pass over the batch, shared by decode sizing and allocation."""
        ps = self.page_size
        return [(slot := r.segments[-1].last_slot) < 0 or slot % ps == ps - 1 for r in reqs]

    def decode_slots_needed(self, reqs: list[Req]) -> int:
        """Slots one decode step takes: a fresh page for each request whose tail page is full."""
        return self.page_size * sum(self._fresh_pages(reqs))

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per decoding request (its pending last token), recorded with one upload and one batched write."""
        ps = self.page_size
        tails = [r.segments[-1] for r in reqs]
        fresh = self._fresh_pages(reqs)
        need = sum(fresh)
        if not self.ensure_free(need * ps):
            return None
        free_pages = iter(self.allocator.alloc_pages(need))
        slots = [next(free_pages) * ps if f else t.last_slot + 1 for t, f in zip(tails, fresh)]
        cols = [t.start + t.done for t in tails]
        for tail, slot in zip(tails, slots):
            tail.done += 1
            tail.last_slot = slot
            tail.own.append(slot)
        device = self.req_to_token_pool.req_to_token.device
        rows, cols_t, out = upload([r.req_pool_idx for r in reqs], cols, slots, device=device).view(3, -1)
        self.req_to_token_pool.req_to_token[rows, cols_t] = out
        return out

    # ---- handing KV to the tree -------------------------------------------------------------------------------
    def cache(self, req: Req) -> None:
        """Insert every segment's computed, page-aligned tokens into the tree and lock the new path."""
        for seg in req.segments:
            if seg.kind == "span" and seg.done == len(seg.tokens):
                self._unclaim(req, seg)
            if self.disable_cache:
                continue
            aligned = seg.done // self.page_size * self.page_size
            if aligned <= seg.cached:
                continue
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            slots = row[seg.start : seg.start + aligned].clone()
            already = self.tree.insert(seg.key(aligned), slots)
            if already > seg.cached:  # the tree had them already: ours are duplicates
                self.allocator.free(_host_slots(seg.own[: already - seg.cached]))
            del seg.own[: aligned - seg.cached]
            result = self.tree.match_prefix(seg.key(aligned))
            assert result.device_indices.numel() == aligned, "tree lost tokens it just inserted"
            self.req_to_token_pool.write(req.req_pool_idx, slice(seg.start, seg.start + aligned), result.device_indices)
            self.tree.inc_lock_ref(result.last_node)
            if seg.lock_node is not None:
                self.tree.dec_lock_ref(seg.lock_node)
            seg.lock_node, seg.cached = result.last_node, aligned
            if seg.done == aligned:  # its last page is full: the next token starts a fresh one
                seg.last_slot = -1

    def release(self, req: Req) -> None:
        """Free the request's own slots, unlock its tree paths and give back its table row."""
        if req.req_pool_idx is None:
            return
        self.inflight_prefixes.pop(req.rid, None)
        for seg in req.segments:
            if seg.kind == "span":
                self._unclaim(req, seg)
            self.allocator.free(_host_slots(seg.own))
            if seg.lock_node is not None:
                self.tree.dec_lock_ref(seg.lock_node)
            seg.lock_node, seg.cached, seg.done, seg.last_slot, seg.own = None, 0, 0, -1, array("q")
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None


def _host_slots(slots: array) -> torch.Tensor:
    """Slot numbers kept on the host, as a tensor for the allocator (a copy: the array may change afterwards)."""
    return torch.frombuffer(slots, dtype=torch.int64).clone() if slots else torch.empty(0, dtype=torch.int64)
