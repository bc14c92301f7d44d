"""Planning shared decode attention on the host, per step: a step's keys cut into runs that requests share, and the
work items of kernels/shared_decode.py over them. Plain integers in, one upload out; no triton, so the scheduler
plans on any backend.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from sglang_pic.kernels.shared_decode_plan import ITEM_FIELDS, MEMBER_FIELDS, SharedDecodePlan, members_per_item
from sglang_pic.utils_tensor import upload

MAX_READ = 0.75  # a step shares its keys when that leaves at most this fraction of a per-request kernel's reads
MIN_SHARED_KEYS = 1024  # GPU: shorter runs cost more in programs of their own than their repeated reads


@dataclass(frozen=True)
class KeyRun:
    """Keys [start, start + length) of one decode request. Requests with runs of the same `key` and length hold the
    same KV slots over them (the caller guarantees it; the engine names a run by the radix node that ends it)."""

    key: Hashable
    start: int
    length: int


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

    @classmethod
    def for_runner(cls, runner) -> SharedDecodeSettings | None:
        """The settings of an engine's steps; None when its model runner decodes each request on its own."""
        if runner.shared_decode_heads is None:
            return None
        heads, kv_heads = runner.shared_decode_heads
        return cls.for_model(heads, kv_heads, runner.attn_backend.sm_count(runner.device), runner.device)


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
