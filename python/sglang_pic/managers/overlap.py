"""Overlap scheduling: a step is launched before the host has committed the tokens of the one before it.

The host reads a step's sampled ids (a device-to-host copy, so it waits for the step) and then commits them:
appends, stop checks, streaming, KV hand-back. Done in order, the GPU idles for all of that and for the next step's
scheduling. Here the next step is scheduled and launched first, its decodes fed by the previous step's ids on the
device (the scheduler's `next_input_ids`), and the host commits the previous step while the GPU runs the next one.
What scheduling needs is known without the tokens: which prefills completed (they decode next), the KV slots of
computed spans (the tree takes them at launch). A request that turns out to have finished in the previous step still
rides in the next one and its row is dropped; one certain to finish by length is left out. Slots freed meanwhile
are safe to reuse: the kernels that reuse them are queued behind the step that still writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_pic.managers.req import Req


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
class LaunchedStep:
    """A step on the device whose sampled tokens the host has not committed yet."""

    reqs: list[Req]  # the sampled rows' requests, in row order
    tokens: PendingTokens
    logits: torch.Tensor | None  # the sampled rows' logits, kept when some request returns logprobs
    decode_only: bool
    _held: set[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._held = {id(r) for r in self.reqs}

    def holds(self, req: Req) -> bool:
        return id(req) in self._held
