"""Overlap scheduling: a step is launched before the host has committed the tokens of the one before it.

The host reads a step's sampled ids (a device-to-host copy, so it waits for the step) and then commits them:
appends, stop checks, streaming, KV hand-back. Done in order, the GPU idles for all of that and for the next step's
scheduling. Here the next step is scheduled and launched first, its decodes fed by the previous step's ids on the
device (the scheduler's `next_input_ids`), and the host commits the previous step while the GPU runs the next one.
What scheduling needs is known without the tokens: which prefills completed (they decode next), the KV slots of
computed spans (the tree takes them at launch). A request that turns out to have finished in the previous step still
rides in the next one and its row is dropped; one certain to finish by length is left out. Slots freed meanwhile
are safe to reuse: the kernels that reuse them are queued behind the step that still writes them. Sampled ids
reach the host through utils_tensor.HostCopy: reading them waits for their step only, not for the one after.
A step with constrained requests is committed between the next step's forward and its sampling, since the next
grammar masks need its tokens: the host's wait and mask filling still run while the device computes the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_pic.managers.req import Req
from sglang_pic.sampling.logprobs import SampledLogprobs
from sglang_pic.utils_tensor import HostCopy


@dataclass
class PromptLogprobs:
    """One batch entry's prompt logprobs on their way to the host: for each position it scored, the logprob of
    the prompt token that follows (`targets`) and the top alternatives."""

    req: Req
    targets: list[int]
    first: int | None  # the prompt's first token, recorded without a logprob, when this entry starts the prompt
    logprobs: SampledLogprobs
    copies: list[HostCopy]

    def record(self) -> None:
        req = self.req
        asks = req.token_ids_logprob is not None
        if self.first is not None:
            req.input_token_logprobs.append((None, self.first))
            req.input_top_logprobs.append(None)
            if asks:
                req.input_token_ids_logprobs.append(None)
        for target, (value, top, asked) in zip(self.targets, self.logprobs.by_row([c.get() for c in self.copies])):
            req.input_token_logprobs.append((value, target))
            req.input_top_logprobs.append(top)
            if asks:
                req.input_token_ids_logprobs.append(asked)


@dataclass
class LaunchedStep:
    """A step on the device whose sampled tokens the host has not committed yet."""

    reqs: list[Req]  # the sampled rows' requests, in row order
    copies: list[HostCopy]  # the sampled ids, then the tensors of `logprobs`, on their way to the host
    logprob_rows: list[int]  # rows whose requests return logprobs
    logprobs: SampledLogprobs | None
    decode_only: bool
    prompt_logprobs: list[PromptLogprobs]  # recorded before the sampled tokens are appended
    dropped: set[int] = field(default_factory=set)  # id() of requests whose row is void: they jumped forward since
    held: set[int] = field(init=False, repr=False)  # id() of each request in `reqs`
    constrained: bool = field(init=False)  # some request has a grammar: commit before the next step's masks

    def __post_init__(self) -> None:
        self.held = {id(r) for r in self.reqs}
        self.constrained = any(r.grammar is not None for r in self.reqs)
