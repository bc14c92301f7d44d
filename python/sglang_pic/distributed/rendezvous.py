"""How the ranks of a tensor-parallel replica meet: at a TCP store on rank 0, without waiting on a dead process.

torch.distributed's tcp:// rendezvous waits for every rank and cannot be told that one has died, so a follower that
fails while starting would leave rank 0 waiting forever. Here each rank checks in at the store and then waits in
short polls, calling `check_peers` between them (it raises once a process this one depends on is gone); the process
group is built on the store once every rank has arrived.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

POLL_S = 0.05
ARRIVED_KEY = "sglang_pic/arrived"


def meet(
    rank: int, size: int, init_method: str, check_peers: Callable[[], None], timeout: timedelta
) -> dist.TCPStore:
    """The store at `init_method` (tcp://host:port, hosted by rank 0) once all `size` ranks have reached it.

    Raises whatever `check_peers` raises while waiting; `timeout` bounds the store's own operations later on.
    """
    address = urlparse(init_method)
    host, port = address.hostname, address.port
    if rank == 0:
        store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
    else:
        _wait_until_listening(host, port, check_peers)
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    store.add(ARRIVED_KEY, 1)
    while store.add(ARRIVED_KEY, 0) < size:
        check_peers()
        time.sleep(POLL_S)
    return store


def _wait_until_listening(host: str, port: int, check_peers: Callable[[], None]) -> None:
    """Until rank 0's store accepts connections. Probed with a plain socket: a store client whose connect times out
    logs a C++ stack trace on every attempt."""
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            check_peers()
            time.sleep(POLL_S)
