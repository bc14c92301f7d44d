"""--step-trace PATH: one JSON line per forward step, so the time of a serving run can be attributed to the device's
work, the host's work it did not hide, and waiting (benchmark/bench_serving_breakdown.py reads it).

The scheduler calls four hooks per call of `Scheduler.step`: the call starts, the forward is called, the forward
(and sampling) is queued, the call ends. From them each step gets its host times: `host_s` from the call's start to
the forward queued (admission, batch build, kernel launches or a graph replay, the launch-time hand-over),
`launch_s` the part inside the forward call, `settle_s` the rest of the call (waiting for a step's tokens and
committing them), and the host time since the last traced call ended, split into `idle_s` (the scheduler had
nothing queued or in flight) and `loop_s` (work was pending: the loop sent outputs and took in requests, or calls
ran no forward).

Device time under overlap scheduling: the forward of step N is queued while step N-1 still runs, and its tokens are
read only in the next call. A CUDA event is recorded right before the forward is called and another once it is
queued; `device_s` is the time between them on the device and `device_gap_s` the time between the previous step's
end event and this one's start, which is the device idling (nothing queued: the host had not launched the step
yet). The events are read only once the end event has passed (`Event.query`, which does not wait), normally at
the end of the call that committed the step's tokens, and lines are written in step order; when the scheduler turns idle
the last events are waited for, so the trace is whole whenever the server is idle. Nothing here makes the host wait
on the device while work is pending. Off CUDA the forward runs on the host: `device_s` is its wall time and
`device_gap_s` the host time between two forwards.

The first line of each run is a header ({"trace": ...}); a file appended to by several runs holds one header each.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import IO

import torch

from sglang_pic.forward_batch import ForwardBatch
from sglang_pic.managers.schedule_batch import StepPlan
from sglang_pic.server_args import ServerArgs

TRACE_VERSION = 1


@dataclass
class StepRecord:
    """One line of the trace: what the forward ran and where its time went (seconds)."""

    step: int  # traced steps so far, this one included
    t: float  # wall clock (time.time()) when the scheduler call that ran the step began
    kind: str  # prefill, decode, mixed (prefill and decodes), span_job, probe, or spec_round (VeriCache)
    reqs: int  # requests in the forward
    new_tokens: int = 0  # token rows the forward computes: extend_tokens + decode_reqs
    decode_reqs: int = 0  # requests decoding one token
    extend_tokens: int = 0  # prefill tokens: prompt chunks, span jobs, probe passes, forced (jump-forward) tokens
    span_job_tokens: int = 0  # of extend_tokens, span jobs'
    probe_tokens: int = 0  # of extend_tokens, probe passes'
    context_tokens: int = 0  # keys the batch's requests address (sum of seq_lens): what decode attention reads
    attn_pairs: int = 0  # query-key pairs of causal attention over the new tokens (an upper bound: spans see less)
    cuda_graph: bool = False  # the forward replayed a CUDA graph
    idle_s: float = 0.0  # host time before the call with nothing queued or in flight
    loop_s: float = 0.0  # host time before the call with work pending, outside calls that ran a forward
    host_s: float = 0.0  # the call's start to the forward queued
    launch_s: float = 0.0  # of host_s, the forward call
    settle_s: float = 0.0  # the forward queued to the call's end: a step's tokens waited for and committed
    device_s: float | None = None  # the forward and sampling on the device (None: a spec round)
    device_gap_s: float | None = None  # the device idle before it (None: the first step, or after a spec round)

    def line(self) -> str:
        fields = {k: round(v, 7) if isinstance(v, float) else v for k, v in self.__dict__.items()}
        return json.dumps(fields, separators=(",", ":"))


@dataclass
class _Launch:
    """The step launched in the current call, until the call ends."""

    record: StepRecord
    called: float = 0.0  # perf_counter when the forward was called
    queued: float = 0.0  # ... and when it returned
    replays: int = 0  # graph replays before the forward
    start: torch.cuda.Event | None = None  # CUDA events around the forward
    end: torch.cuda.Event | None = None


def step_kind(plan: StepPlan, batch: ForwardBatch) -> str:
    if batch.forward_mode.is_decode():
        return "decode"
    if batch.num_decodes:
        return "mixed"
    if all(e.req.warmup for e in plan.entries):
        return "span_job"
    if all(e.req.probe is not None for e in plan.entries):
        return "probe"
    return "prefill"


def for_replica(args: ServerArgs, dp_rank: int) -> ServerArgs:
    """`args` of data-parallel replica `dp_rank`: with several replicas each traces into PATH.dp<rank>, since one
    file appended to by several processes could interleave their lines."""
    if args.step_trace is None or args.dp_size == 1:
        return args
    return dataclasses.replace(args, step_trace=f"{args.step_trace}.dp{dp_rank}")


class StepTracer:
    def __init__(self, file: IO[str], runner, overlap: bool) -> None:
        self._file = file
        self._graphs = runner.graph_runner  # its replay counters tell whether a forward replayed a graph
        self._cuda = runner.device.type == "cuda"
        self._wall0, self._perf0 = time.time(), time.perf_counter()
        self._steps = 0
        self._call = self._ended = self._perf0  # the current call's start; the last call's end
        self._ended_idle = True  # the scheduler had nothing to do when the last call ended
        self._idle = self._loop = 0.0  # host time since the last traced call, by cause
        self._launch: _Launch | None = None
        self._spec_reqs: int | None = None  # a spec round ran in this call, for this many requests
        self._unread: deque[_Launch] = deque()  # CUDA steps whose events have not passed yet
        self._prev_end: torch.cuda.Event | float | None = None  # the last written step's end (event, or host clock)
        self._spare: list[torch.cuda.Event] = []
        header = {
            "trace": "sglang_pic step trace", "version": TRACE_VERSION, "t": self._wall0,
            "device": runner.device.type, "device_timing": "cuda_events" if self._cuda else "host_clock",
            "overlap": overlap, "model_path": runner.server_args.model_path, "tp_size": runner.server_args.tp_size,
            "kv_bytes": runner.token_to_kv_pool.dtype.itemsize,  # an fp8 pool halves its KV reads
        }
        file.write(json.dumps(header) + "\n")
        file.flush()

    @classmethod
    def open(cls, path: str, runner, overlap: bool) -> StepTracer:
        """Append to `path`; an unwritable path fails here, at start-up."""
        return cls(open(path, "a", encoding="utf-8"), runner, overlap)

    # ---- hooks --------------------------------------------------------------------------------------------------
    def call_started(self) -> None:
        now = time.perf_counter()
        if self._ended_idle:
            self._idle += now - self._ended
        else:
            self._loop += now - self._ended
        self._call = now

    def forward_called(self, plan: StepPlan, batch: ForwardBatch) -> None:
        seq, ext = batch.seq_lens_cpu, batch.extend_seq_lens_cpu
        decodes = batch.num_decodes
        k = len(seq) - decodes  # rows before the decodes extend
        tokens = len(batch.positions_cpu)
        self._steps += 1
        record = StepRecord(
            step=self._steps, t=self._wall0 + self._call - self._perf0, kind=step_kind(plan, batch), reqs=len(seq),
            new_tokens=tokens, decode_reqs=decodes, extend_tokens=tokens - decodes,
            span_job_tokens=sum(e.num_tokens for e in plan.entries if e.req.warmup),
            probe_tokens=sum(e.num_tokens for e in plan.entries if e.req.probe is not None),
            context_tokens=sum(seq),
            attn_pairs=sum(seq[k:]) + sum(n * s - n * (n - 1) // 2 for n, s in zip(ext[:k], seq[:k])),
        )
        launch = _Launch(record, replays=self._replays())
        if self._cuda:
            launch.start = self._event()
        launch.called = time.perf_counter()
        self._launch = launch

    def forward_queued(self) -> None:
        launch = self._launch
        launch.queued = time.perf_counter()
        if self._cuda:
            launch.end = self._event()
        launch.record.cuda_graph = self._replays() != launch.replays

    def spec_round(self, reqs: int) -> None:
        """A VeriCache round (its own draft and verify forwards) ran in this call."""
        self._spec_reqs = reqs

    def call_ended(self, idle: bool) -> None:
        """The call returned; `idle`: the scheduler has nothing queued or in flight now."""
        now = time.perf_counter()
        launch, self._launch = self._launch, None
        if launch is not None:
            self._finish(launch, now)
        elif self._spec_reqs is not None:
            self._unread.append(self._spec_launch(now))
        else:
            self._loop += now - self._call  # a call that ran no forward
        self._spec_reqs = None
        self._ended, self._ended_idle = now, idle
        self._write_passed(wait=idle)
        if idle:
            self._file.flush()

    def close(self) -> None:
        self._write_passed(wait=True)
        self._file.close()

    # ---- records ------------------------------------------------------------------------------------------------
    def _finish(self, launch: _Launch, now: float) -> None:
        record = launch.record
        record.idle_s, record.loop_s, self._idle, self._loop = self._idle, self._loop, 0.0, 0.0
        record.host_s = launch.queued - self._call
        record.launch_s = launch.queued - launch.called
        record.settle_s = now - launch.queued
        if self._cuda:
            self._unread.append(launch)
            return
        record.device_s = record.launch_s
        if isinstance(self._prev_end, float):
            record.device_gap_s = launch.called - self._prev_end
        self._prev_end = launch.queued
        self._file.write(record.line() + "\n")

    def _spec_launch(self, now: float) -> _Launch:
        self._steps += 1
        record = StepRecord(
            step=self._steps, t=self._wall0 + self._call - self._perf0, kind="spec_round", reqs=self._spec_reqs,
            decode_reqs=self._spec_reqs, idle_s=self._idle, loop_s=self._loop, host_s=now - self._call,
        )
        self._idle = self._loop = 0.0
        return _Launch(record)

    def _write_passed(self, wait: bool) -> None:
        """Write the oldest steps whose end has passed on the device (all of them, waiting for it, when `wait`)."""
        while self._unread:
            launch = self._unread[0]
            if launch.end is not None and not launch.end.query():
                if not wait:
                    return
                launch.end.synchronize()
            self._unread.popleft()
            record = launch.record
            if launch.end is None:  # a spec round: its forwards are not timed, and the next gap is unknown
                self._recycle(self._prev_end)
                self._prev_end = None
            else:
                record.device_s = launch.start.elapsed_time(launch.end) / 1e3
                if isinstance(self._prev_end, torch.cuda.Event):
                    record.device_gap_s = self._prev_end.elapsed_time(launch.start) / 1e3
                self._recycle(self._prev_end)
                self._recycle(launch.start)
                self._prev_end = launch.end
            self._file.write(record.line() + "\n")

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _replays(self) -> int:
        return 0 if self._graphs is None else sum(self._graphs.num_replays.values())

    def _event(self) -> torch.cuda.Event:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _recycle(self, event: torch.cuda.Event | float | None) -> None:
        if isinstance(event, torch.cuda.Event):
            self._spare.append(event)
