"""Moving the scheduler's Python numbers to the device cheaply: one conversion, one copy, no host stall."""

from __future__ import annotations

from array import array

import torch

_TYPECODES = {torch.int64: "q", torch.float32: "f"}


def host_tensor(*columns: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The lists in `columns`, concatenated into one host tensor (int64 or float32).

    Goes through array.fromlist, several times faster than torch.tensor on a list of Python numbers.
    """
    buffer = array(_TYPECODES[dtype])
    for column in columns:
        buffer.fromlist(column)
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to `device` without making the host wait.

    On CUDA the copy goes through pinned memory and does not block: a copy from pageable memory would make the
    host wait for every kernel already queued. PyTorch's pinned allocator keeps the staging block until the copy
    has run, so nothing here has to outlive the call.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload(*columns: list, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The lists in `columns`, concatenated into one tensor on `device`: one conversion and one copy."""
    return to_device(host_tensor(*columns, dtype=dtype), device)


class HostCopy:
    """A device tensor's values on the host, copied without making the host wait for the stream.

    `.cpu()` or `.tolist()` of a device tensor waits for every kernel already queued, the step in flight included.
    Here the copy goes non-blocking into pinned memory and an event marks its end; `get` waits on that event alone,
    and only the first time. Slices share the copy."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        self.tensor = tensor
        self.event = event

    def __getitem__(self, index: slice) -> HostCopy:
        return HostCopy(self.tensor[index], self.event)

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensor


def record_event(device: torch.device) -> torch.cuda.Event | None:
    """An event marking the work queued so far on `device`'s current stream; None off CUDA, where queued work is
    done already."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def copy_to_host(*tensors: torch.Tensor) -> list[HostCopy]:
    """Start host copies of `tensors` (one event for all); host tensors are taken as they are."""
    if not tensors[0].is_cuda:
        return [HostCopy(t) for t in tensors]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, device in zip(hosts, tensors):
        host.copy_(device, non_blocking=True)
    event = record_event(tensors[0].device)
    return [HostCopy(host, event) for host in hosts]
