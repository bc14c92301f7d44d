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
from sglang_pic.sampling.logprobs import SampledLogprobs


class PendingCopy:
    """Device tensors on their way to the host: non-blocking copies into pinned memory and the event that ends them.

    A plain `.tolist()` of a device tensor would wait for everything queued on the stream, the step launched
    after it included; waiting on the event waits only for the step that produced them."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event = None
        self.host = tensors
        if tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, device in zip(self.host, tensors):
                host.copy_(device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass
class LaunchedStep:
    """A step on the device whose sampled tokens the host has not committed yet."""

    reqs: list[Req]  # the sampled rows' requests, in row order
    copy: PendingCopy  # the sampled ids, then the tensors of `logprobs`
    logprob_rows: list[int]  # rows whose requests return logprobs
    logprobs: SampledLogprobs | None
    decode_only: bool
    _held: set[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._held = {id(r) for r in self.reqs}

    def holds(self, req: Req) -> bool:
        return id(req) in self._held
