"""The host side of shared decode attention (kernels/shared_decode.py): one decode step's keys cut into runs that
requests share, and the work items the kernel runs over them. Plain integers in, one upload out; no triton, so the
scheduler imports it on any backend.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from sglang_pic.utils_tensor import upload

ITEM_FIELDS = 6  # row, first key (column of the row), key count, index of the first key in its run, members lo, count
MEMBER_FIELDS = 3  # decode row, query rotation (position - run start), partial slot
MAX_QUERY_ROWS = 64  # member queries x GQA group per program
MAX_READ = 0.75  # a step shares its keys when that leaves at most this fraction of a per-request kernel's reads
MIN_SHARED_KEYS = 1024  # GPU: shorter runs cost more in programs of their own than their repeated reads
# Static plans of CUDA graphs: items per request (plus a constant) and partial outputs per request they hold.
ITEMS_PER_REQUEST, EXTRA_ITEMS, PARTIALS_CAPACITY = 4, 128, 32


@dataclass(frozen=True)
class KeyRun:
    """Keys [start, start + length) of one decode request. Requests with runs of the same `key` and length hold the
    same KV slots over them (the caller guarantees it; the engine names a run by the radix node that ends it)."""

    key: Hashable
    start: int
    length: int


@dataclass
class SharedDecodePlan:
    """One step's work, on the device: `items` [n, ITEM_FIELDS], `members` [m, MEMBER_FIELDS], `counts` [B]
    partials per request, `num_items` [1] the live items (a CUDA graph's static plan has more rows than live
    ones). On the host: `max_partials` bounds any request's partials; `keys_read` / `keys_per_request`: keys the
    plan loads per kv head against what a per-request kernel would (a step's saving)."""

    items: torch.Tensor
    members: torch.Tensor
    counts: torch.Tensor
    num_items: torch.Tensor
    max_partials: int
    members_per_item: int
    keys_read: int = 0
    keys_per_request: int = 0

    def flat(self) -> torch.Tensor:
        """Everything as one int64 tensor (tensor parallelism broadcasts it); `from_flat` undoes it."""
        return torch.cat([self.items.flatten(), self.members.flatten(), self.counts, self.num_items])

    @classmethod
    def from_flat(cls, flat: torch.Tensor, sizes: tuple[int, int, int, int]) -> SharedDecodePlan:
        """`sizes`: (items, member entries, max_partials, members_per_item), as `sizes()` gives them."""
        num_items, num_members, max_partials, per_item = sizes
        lengths = [num_items * ITEM_FIELDS, num_members * MEMBER_FIELDS]
        items, members, rest = flat.split(lengths + [flat.numel() - sum(lengths)])
        return cls(items.view(-1, ITEM_FIELDS), members.view(-1, MEMBER_FIELDS), rest[:-1], rest[-1:], max_partials,
                   per_item)

    def sizes(self) -> tuple[int, int, int, int]:
        return self.items.shape[0], self.members.shape[0], self.max_partials, self.members_per_item


@dataclass
class StaticSharedPlan:
    """Plan tensors of fixed size that captured CUDA graphs read: the graph of `reqs` requests reads the first
    `item_capacity(reqs)` items (its kernel grid) and PARTIALS_CAPACITY partial slots per request; a replay copies
    the step's plan in. A plan that does not fit replays the graph of per-request decode instead."""

    items: torch.Tensor
    members: torch.Tensor
    counts: torch.Tensor
    num_items: torch.Tensor
    members_per_item: int

    @staticmethod
    def item_capacity(reqs: int) -> int:
        return ITEMS_PER_REQUEST * reqs + EXTRA_ITEMS

    @classmethod
    def allocate(cls, reqs: int, members_per_item: int, device: torch.device) -> StaticSharedPlan:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(zeros(cls.item_capacity(reqs), ITEM_FIELDS), zeros(reqs * PARTIALS_CAPACITY, MEMBER_FIELDS),
                   zeros(reqs), zeros(1), members_per_item)

    def view(self, reqs: int) -> SharedDecodePlan:
        """What the graph of `reqs` requests captures (no live items until a replay loads some)."""
        return SharedDecodePlan(self.items[: self.item_capacity(reqs)], self.members[: reqs * PARTIALS_CAPACITY],
                                self.counts[:reqs], self.num_items, PARTIALS_CAPACITY, self.members_per_item)

    def fits(self, plan: SharedDecodePlan, reqs: int) -> bool:
        items, members, max_partials, per_item = plan.sizes()
        return (items <= self.item_capacity(reqs) and members <= reqs * PARTIALS_CAPACITY
                and max_partials <= PARTIALS_CAPACITY and per_item == self.members_per_item)

    def load(self, plan: SharedDecodePlan, live: int, padded: int) -> None:
        """Copy `plan` of `live` requests in; padded requests get no partials (their rows attend to nothing)."""
        self.items[: plan.items.shape[0]].copy_(plan.items)
        self.members[: plan.members.shape[0]].copy_(plan.members)
        self.counts[:live].copy_(plan.counts)
        self.counts[live:padded].zero_()
        self.num_items.copy_(plan.num_items)


def members_per_item(group: int) -> int:
    """Member requests one program attends for: MAX_QUERY_ROWS query rows of `group` heads each."""
    return max(1, MAX_QUERY_ROWS // group)


@dataclass(frozen=True)
class SharedDecodeSettings:
    """How an engine cuts its steps (see plan_shared_decode). `min_shared`: the shortest run read once for its
    holders (a shorter one is read by each, with the keys around it); `max_read`: the largest fraction of a
    per-request kernel's key reads a plan may keep, else the step reads keys per request."""

    members: int
    min_chunk: int
    target_items: int
    max_read: float
    min_shared: int = 1

    @classmethod
    def for_model(cls, num_heads: int, num_kv_heads: int, num_sms: int, device: torch.device) -> SharedDecodeSettings:
        """About four programs per SM; on a GPU chunks of at least 256 keys (shorter ones are not worth a program)
        and shared runs of at least MIN_SHARED_KEYS; 16 and 8 on the CPU interpreter so small tests share too."""
        gpu = device.type == "cuda"
        return cls(
            members=members_per_item(num_heads // num_kv_heads),
            min_chunk=256 if gpu else 16,
            target_items=max(1, 4 * num_sms // num_kv_heads),
            max_read=MAX_READ,
            min_shared=MIN_SHARED_KEYS if gpu else 8,
        )


def plan_shared_decode(
    rows: list[int], seq_lens: list[int], runs: list[list[KeyRun]], settings: SharedDecodeSettings,
    device: torch.device | str,
) -> SharedDecodePlan | None:
    """The work of one decode step, or None when sharing would keep more than `settings.max_read` of the reads.

    Request b (row `rows[b]`, query at seq_lens[b] - 1) sees keys [0, seq_lens[b]) and lists the runs it may share
    in `runs[b]` (sorted, disjoint, inside its keys). A run of at least `min_shared` keys that another request of
    the step holds too is shared; every other key is in its request's private runs, the stretches between shared
    runs. Runs are cut into chunks of equal bound, at least `min_chunk` keys, so that the step has about
    `target_items` of them; a group's requests go `members` per item."""
    holders: dict[tuple, int] = {}
    for request_runs in runs:
        for run in request_runs:
            if run.length >= settings.min_shared:
                holders[(run.key, run.length)] = holders.get((run.key, run.length), 0) + 1
    groups: dict[tuple, list[tuple[int, int]]] = {}  # (key, length) -> [(request, run start)]
    private: list[tuple[int, int, int]] = []  # (request, start, length)
    for b, (request_runs, seq_len) in enumerate(zip(runs, seq_lens)):
        at = 0
        for run in request_runs:
            if holders.get((run.key, run.length), 0) < 2:
                continue
            if run.start > at:
                private.append((b, at, run.start - at))
            groups.setdefault((run.key, run.length), []).append((b, run.start))
            at = run.start + run.length
        if seq_len > at:
            private.append((b, at, seq_len - at))
    runs_by_group = [(length, found) for (_, length), found in groups.items()]
    runs_by_group += [(length, [(b, start)]) for b, start, length in private]
    keys_read = sum(length for length, _ in runs_by_group)
    keys_per_request = sum(seq_lens)
    if keys_read > settings.max_read * keys_per_request:
        return None

    chunk_keys = max(settings.min_chunk, -(-keys_read // settings.target_items))
    members = settings.members
    items: list[int] = []
    entries: list[int] = []
    counts = [0] * len(rows)
    for length, found in runs_by_group:
        rep, rep_start = found[0]
        for lo in range(0, length, chunk_keys):
            n = min(chunk_keys, length - lo)
            for t in range(0, len(found), members):
                tile = found[t : t + members]
                items += [rows[rep], rep_start + lo, n, lo, len(entries) // MEMBER_FIELDS, len(tile)]
                for b, start in tile:
                    entries += [b, seq_lens[b] - 1 - start, counts[b]]
                    counts[b] += 1
    flat = upload(items, entries, counts, [len(items) // ITEM_FIELDS], device=device)
    n_items, n_entries = len(items), len(entries)
    return SharedDecodePlan(
        items=flat[:n_items].view(-1, ITEM_FIELDS),
        members=flat[n_items : n_items + n_entries].view(-1, MEMBER_FIELDS),
        counts=flat[n_items + n_entries : -1],
        num_items=flat[-1:],
        max_partials=max(counts, default=0),
        members_per_item=members,
        keys_read=keys_read,
        keys_per_request=keys_per_request,
    )
