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

The step loop hands the launched step to the next call as its LastStep. Its tokens reach the requests through
`LastStep.settle` alone: scheduling settles it when it needs them on the host first (a retraction or preemption of a
request whose token is in it, a decode short of KV that requests finishing in it may free, grammar masks), else the
loop settles it once the next step is launched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_pic.managers.req import Req
from sglang_pic.managers.schedule_batch import StepPlan
from sglang_pic.model_executor.step_sampler import PromptLogprobAsk, SampledOutput
from sglang_pic.sampling.logprobs import SampledLogprobs
from sglang_pic.utils_tensor import HostCopy

_NONE_HELD: frozenset[int] = frozenset()


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
class StepRows:
    """What a plan's logits rows are for: each entry's prompt-logprob rows (positions it scores), then its sampled
    row when its prefill completes; then one sampled row per decode."""

    reqs: list[Req]  # the sampled rows' requests, in row order
    sample_rows: list[int] | None  # the logits rows sampled; None: all of them (no prompt logprobs)
    asks: list[PromptLogprobAsk]
    firsts: list[int | None]  # per ask, the prompt's first token when the ask starts the prompt

    @classmethod
    def of(cls, plan: StepPlan) -> StepRows:
        row, sample_rows, sampled, asks, firsts = 0, [], [], [], []
        for e in plan.entries:
            if e.logprob_positions:
                req, positions = e.req, e.logprob_positions
                ids = req.prompt_ids()
                asks.append(PromptLogprobAsk(row, [ids[p + 1] for p in positions], req.top_logprobs_num,
                                             req.token_ids_logprob))
                firsts.append(ids[0] if req.logprob_start_len == 0 and positions[0] == 0 else None)
                row += len(positions)
            if e.completes and e.req.samples():
                sample_rows.append(row)
                sampled.append(e.req)
                row += 1
        decodes = plan.decode.reqs if plan.decode is not None else []
        reqs = sampled + decodes
        keep = sample_rows + list(range(row, row + len(decodes))) if asks and reqs else None
        return cls(reqs, keep, asks, firsts)


@dataclass
class LaunchedStep:
    """A step on the device whose sampled tokens the host has not committed yet."""

    reqs: list[Req]  # the sampled rows' requests, in row order
    out: SampledOutput  # the sampled ids and logprobs on their way to the host; rows `out.void` are dropped
    decode_only: bool
    prompt_logprobs: list[PromptLogprobs]  # recorded before the sampled tokens are appended
    held: set[int] = field(init=False, repr=False)  # id() of each request in `reqs`
    constrained: bool = field(init=False)  # some request has a grammar: commit before the next step's masks

    def __post_init__(self) -> None:
        self.held = {id(r) for r in self.reqs}
        self.constrained = any(r.grammar is not None for r in self.reqs)


class LastStep:
    """The step launched before this one, handed to this step's scheduling (see the module doc)."""

    __slots__ = ("step", "_commit")

    def __init__(self, step: LaunchedStep | None, commit: Callable[[LaunchedStep], None]) -> None:
        self.step = step  # None once settled (or when nothing was left in flight)
        self._commit = commit

    @property
    def held(self) -> set[int] | frozenset[int]:
        """id() of the requests whose last sampled token is in the step, not committed yet."""
        return self.step.held if self.step is not None else _NONE_HELD

    def holds(self, req: Req) -> bool:
        return self.step is not None and id(req) in self.step.held

    @property
    def constrained(self) -> bool:
        return self.step is not None and self.step.constrained

    def settle(self) -> bool:
        """Commit the step's tokens now (once); whether there was a step to commit."""
        if self.step is None:
            return False
        step, self.step = self.step, None
        self._commit(step)
        return True

    def drop(self) -> None:
        """Forget the step uncommitted: every request in it has finished or was aborted, so all its rows are void."""
        self.step = None
