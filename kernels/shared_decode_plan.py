"""The work plan that shared decode attention (kernels/shared_decode.py) reads: its tensor layout, the static plan
that CUDA graphs capture, and how many member requests one program attends for. The scheduler builds a plan per
step (managers/shared_decode_planner.py); this module holds only what the kernel and its graphs consume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ITEM_FIELDS = 6  # row, first key (column of the row), key count, index of the first key in its run, members lo, count
MEMBER_FIELDS = 3  # decode row, query rotation (position - run start), partial slot
MAX_QUERY_ROWS = 64  # member queries x GQA group per program
# Static plans of CUDA graphs: items per request (plus a constant) and partial outputs per request they hold.
ITEMS_PER_REQUEST, EXTRA_ITEMS, PARTIALS_CAPACITY = 4, 128, 32


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
