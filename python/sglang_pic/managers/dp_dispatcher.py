"""Data parallelism inside one server: which scheduler process (model replica) gets each request.

Every replica has its own KV cache, so a request stays on the replica it was sent to; aborts follow it there. The
main process counts each replica's unfinished requests, which is what `shortest_queue` balances (SGLang's
`--load-balance-method`). Control messages (flush, stats, span warm-up) go to every replica.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

import zmq

from sglang_pic.managers.ipc import IpcNames, SchedulerSnapshot, push_socket


class DataParallelDispatcher:
    def __init__(self, ctx: zmq.Context, names: IpcNames, dp_size: int, method: str) -> None:
        self.sockets = [push_socket(ctx, names.for_dp_rank(rank).scheduler_input) for rank in range(dp_size)]
        self.method = method
        self.owner: dict[str, int] = {}  # rid -> replica, while the request is unfinished
        self.load = [0] * dp_size
        self._turn = itertools.cycle(range(dp_size))

    @property
    def dp_size(self) -> int:
        return len(self.sockets)

    def _pick(self) -> int:
        if self.method == "shortest_queue":
            return min(range(self.dp_size), key=self.load.__getitem__)
        return next(self._turn)

    def submit(self, rid: str, msg: object, rank: int | None = None) -> int:
        """Send a new request to replica `rank`, or to the one the load-balance method picks."""
        rank = self._pick() if rank is None else rank
        self.owner[rid] = rank
        self.load[rank] += 1
        self.sockets[rank].send_pyobj(msg)
        return rank

    def to_owner(self, rid: str, msg: object) -> None:
        """Send to the replica running `rid`; to all of them when it is unknown here (finished or never sent)."""
        rank = self.owner.get(rid)
        if rank is None:
            self.broadcast(msg)
        else:
            self.sockets[rank].send_pyobj(msg)

    def send(self, rank: int, msg: object) -> None:
        self.sockets[rank].send_pyobj(msg)

    def broadcast(self, msg: object) -> None:
        for sock in self.sockets:
            sock.send_pyobj(msg)

    def release(self, rid: str) -> None:
        """`rid` finished or was given up on: it no longer counts towards its replica's load."""
        rank = self.owner.pop(rid, None)
        if rank is not None:
            self.load[rank] -= 1

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


def combine_snapshots(snapshots: list[SchedulerSnapshot]) -> SchedulerSnapshot:
    """The server-wide view of several replicas: counters and pool sizes add up."""
    if len(snapshots) == 1:
        return snapshots[0]
    total = {key: sum(getattr(s, key) for s in snapshots) for key in asdict(snapshots[0]) if key != "token_usage"}
    free = total["available_tokens"] + total["evictable_tokens"]
    return SchedulerSnapshot(**total, token_usage=1.0 - free / max(total["max_total_num_tokens"], 1))
