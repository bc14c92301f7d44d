"""Typed messages between the server's processes, and the ZMQ sockets that carry them.

Three processes talk over ipc:// sockets in one temp dir, each pipe one-way (PUSH -> PULL), as in SGLang:

    main (HTTP + ServerTokenizerManager) --requests/control--> scheduler
    scheduler --per-step token deltas--> detokenizer --formatted outputs--> main
    scheduler --control replies--> main

A request travels to the scheduler as a TokenizedGenerateReq (io_struct.py), plain data from which the scheduler
builds its own Req. Back it comes as a `TokenDelta` per report (new token ids, new logprobs, finish state), the first
one with a `ReqHeader` (what formatting needs to know of the request); see managers/output_format.py.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import zmq

from sglang_pic.managers.io_struct import TokenizedSegment
from sglang_pic.managers.req import FinishReason
from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.speculative.spec_stats import accept_length, accept_rate


# ---- main -> scheduler (besides io_struct.TokenizedGenerateReq) -------------------------------------------------
@dataclass
class AbortRequest:
    rid: str = ""
    abort_all: bool = False


@dataclass
class FlushCacheRequest:
    request_id: str


@dataclass
class StatsRequest:
    request_id: str


@dataclass
class UpdateWeightsRequest:
    """Serve another checkpoint of the same model; applied once the replica is idle (new requests wait)."""

    request_id: str
    model_path: str
    load_format: str | None = None


@dataclass
class WarmSpansRequest:
    """Prefill spans (as a request's span segments, RequestBuilder.span_segments) into the cache; answered once
    every one is cached."""

    request_id: str
    spans: list[TokenizedSegment]


@dataclass
class ProfileRequest:
    """Start (with StepProfiler.start's arguments in `options`) or stop the scheduler's torch.profiler run."""

    request_id: str
    start: bool
    options: dict = field(default_factory=dict)


# ---- scheduler -> main ----------------------------------------------------------------------------------------
@dataclass
class FlushCacheResult:
    request_id: str
    success: bool


@dataclass
class UpdateWeightsResult:
    request_id: str
    success: bool
    message: str


@dataclass
class ProfileResult:
    request_id: str
    success: bool
    message: str  # the trace's path, or why not


@dataclass
class WarmSpansResult:
    request_id: str
    num_spans: int
    span_tokens: int
    computed_tokens: int


@dataclass
class SchedulerSnapshot:
    """Cumulative counters and current load of the scheduler, for /metrics, /get_server_info and /get_load."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_tokens: int
    max_total_num_tokens: int
    available_tokens: int  # free KV slots
    evictable_tokens: int  # slots held only by the radix cache
    token_usage: float  # share of the pool held by requests (neither free nor evictable)
    prompt_tokens: int
    generation_tokens: int
    cached_prefix_tokens: int
    cached_span_tokens: int
    computed_prefill_tokens: int
    num_retractions: int
    num_steps: int
    num_preemptions: int = 0  # running requests retracted for more urgent ones (priority scheduling)
    shared_decode_steps: int = 0  # steps whose decodes read shared KV runs once (kernels/shared_decode.py)
    host_cache_tokens: int = 0  # hierarchical cache: tokens whose KV waits in host memory
    host_cache_loaded_tokens: int = 0  # tokens brought back from it to the device
    # VeriCache totals (speculation off: all 0); see speculative/spec_stats.py
    spec_verify_ct: int = 0  # request-rounds: one request verified once
    spec_draft_tokens: int = 0
    spec_accepted_drafts: int = 0
    spec_committed_tokens: int = 0  # accepted drafts plus one corrected or bonus token per request-round
    spec_draft_time_s: float = 0.0
    spec_verify_time_s: float = 0.0
    spec_h2d_bytes: int = 0  # host-tier full KV streamed to the device

    @property
    def used_tokens(self) -> int:
        return self.max_total_num_tokens - self.available_tokens - self.evictable_tokens

    @property
    def spec_accept_length(self) -> float:
        """Tokens a request gets per verification (1.0: speculation buys nothing)."""
        return accept_length(self.spec_committed_tokens, self.spec_verify_ct)

    @property
    def spec_accept_rate(self) -> float:
        return accept_rate(self.spec_accepted_drafts, self.spec_draft_tokens)

    @property
    def cache_hit_rate(self) -> float:
        if self.prompt_tokens == 0:
            return 0.0
        return (self.cached_prefix_tokens + self.cached_span_tokens) / self.prompt_tokens


@dataclass
class StatsResult:
    request_id: str
    snapshot: SchedulerSnapshot


@dataclass
class SchedulerReady:
    """Sent over the start-up pipe once the model is loaded (or `error` if it could not be)."""

    max_total_num_tokens: int = 0
    context_len: int = 0
    error: str | None = None


# ---- scheduler -> detokenizer ---------------------------------------------------------------------------------
@dataclass
class ReqHeader:
    """What the detokenizer needs to know about a request, sent with its first delta only."""

    prompt_len: int
    sampling_params: SamplingParams
    created_time: float
    return_logprob: bool
    return_text_in_logprobs: bool
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    token_ids_logprob: list[int] | None = None
    input_token_ids_logprobs: list = field(default_factory=list)


@dataclass
class TokenDelta:
    rid: str
    new_ids: list[int]
    finished_reason: FinishReason | None
    cached_prefix_tokens: int
    cached_span_tokens: int
    recomputed_span_tokens: int
    probe_tokens: int
    first_token_time: float | None
    new_output_token_logprobs: list = field(default_factory=list)
    new_output_top_logprobs: list = field(default_factory=list)
    new_output_token_ids_logprobs: list = field(default_factory=list)
    spec_meta: dict | None = None  # the request's VeriCache counters so far (ReqSpecStats.to_meta); None: not drafted
    header: ReqHeader | None = None


@dataclass
class BatchTokenOutput:
    deltas: list[TokenDelta]


# ---- detokenizer -> main --------------------------------------------------------------------------------------
@dataclass
class GenerateOutput:
    """One request's output so far, already in the `/generate` wire format (cumulative text and ids)."""

    rid: str
    out: dict[str, Any]
    finished: bool


@dataclass
class BatchGenerateOutput:
    outputs: list[GenerateOutput]


# ---- sockets --------------------------------------------------------------------------------------------------
@dataclass
class IpcNames:
    """The ipc:// endpoints of one server; each is bound by its reader."""

    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def in_new_tempdir(cls) -> "IpcNames":
        root = tempfile.mkdtemp(prefix="sglang_pic_ipc_")
        return cls(*(f"ipc://{os.path.join(root, name)}" for name in ("scheduler", "detokenizer", "tokenizer")))

    def for_dp_rank(self, dp_rank: int) -> "IpcNames":
        """The names a data-parallel replica uses: its own scheduler input, the shared outputs (rank 0: as is)."""
        if dp_rank == 0:
            return self
        return dataclasses.replace(self, scheduler_input=f"{self.scheduler_input}_dp{dp_rank}")

    def cleanup(self) -> None:
        dp_inputs = glob.glob(self.scheduler_input.removeprefix("ipc://") + "_dp*")
        for name in (self.scheduler_input, self.detokenizer_input, self.tokenizer_input, *dp_inputs):
            path = name.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        root = os.path.dirname(self.scheduler_input.removeprefix("ipc://"))
        if os.path.isdir(root) and not os.listdir(root):
            os.rmdir(root)


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def recv_all_nowait(sock: zmq.Socket) -> list[Any]:
    """Every message already queued on `sock`, without blocking."""
    msgs = []
    while True:
        try:
            msgs.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            return msgs
