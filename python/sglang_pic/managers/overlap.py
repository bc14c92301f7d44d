"""Overlap scheduling: a decode step is launched before the host has read the tokens of the one before it.

The host reads a step's sampled ids (a device-to-host copy, so it waits for the step) and then commits them:
appends, stop checks, streaming, KV hand-back. Done in order, the GPU idles for all of that between steps. Here the
next decode step is launched first, fed by the previous step's ids on the device, and the host commits the previous
step while the GPU runs the next one. A request that turns out to have finished in the previous step still rides
in the next one; its row is dropped. Its slots are freed at once: the kernels that later reuse them are queued
behind the step that still writes them, so stream order keeps them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_pic.managers.req import Req
from sglang_pic.utils_tensor import upload


class PendingTokens:
    """Sampled ids on their way to the host: a non-blocking copy into pinned memory and the event that ends it.

    A plain `.tolist()` of a device tensor would wait for everything queued on the stream, the step launched
    after it included; waiting on the event waits only for the step that sampled them."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.device_ids = ids
        self.event = None
        if ids.is_cuda:
            self.host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self.host.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = ids

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class LaunchedDecode:
    """A decode step on the device whose tokens the host has not committed yet."""

    reqs: list[Req]
    tokens: PendingTokens

    def input_ids_for(self, reqs: list[Req]) -> torch.Tensor:
        """The sampled ids of `reqs` (all in this step), as the next step's input ids, without leaving the device."""
        if reqs == self.reqs:
            return self.tokens.device_ids
        row = {id(r): i for i, r in enumerate(self.reqs)}
        return self.tokens.device_ids[upload([row[id(r)] for r in reqs], device=self.tokens.device_ids.device)]
