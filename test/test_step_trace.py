"""--step-trace: the offline Engine writes one line per forward step that agrees with the requests it ran (with and
without overlap scheduling), the CUDA timing reads its events only once they have passed, and
benchmark/bench_serving_breakdown.py attributes a trace's time with totals that add up to the trace's."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_serving_breakdown  # noqa: E402

from sglang_pic import Engine  # noqa: E402
from sglang_pic.frontend_lang.markers import span  # noqa: E402
from sglang_pic.managers.step_trace import StepTracer, for_replica  # noqa: E402
from sglang_pic.server_args import ServerArgs  # noqa: E402

WARMED = "The capital of France is Paris, the capital of Japan is Tokyo, and the capital of Italy is Rome."
DOC = "A serving engine batches requests and streams tokens back to each client while the weather stays sunny."
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Once upon a time",
    "Read." + span(DOC) + "What is in it?",
]
NEW_TOKENS = 4
KINDS = {"prefill", "decode", "mixed", "span_job", "probe"}


def _lines(path: Path) -> tuple[dict, list[dict]]:
    header, *steps = [json.loads(line) for line in path.read_text().splitlines()]
    return header, steps


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "no-overlap"])
def traced(request, tiny_llama, tmp_path_factory):
    """A run with a warmed span (span job steps), plain prompts and a span prompt with a probe pass, chunked so
    prefills take several steps; (trace path, what the run did)."""
    path = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, span_head_tokens=0,
                chunked_prefill_size=16, disable_overlap_schedule=request.param, step_trace=str(path)) as engine:
        warmed = engine.warm_spans([WARMED])
        outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                               span_query_share=[None, None, 0.5])
        stats = engine.get_stats()
    return path, SimpleNamespace(warmed=warmed, outs=outs, stats=stats, overlap=not request.param)


def test_every_step_is_traced_and_agrees_with_the_requests(traced):
    path, run = traced
    header, steps = _lines(path)
    assert header["trace"] and header["device"] == "cpu" and header["overlap"] == run.overlap
    assert header["kv_bytes"] == 4  # a float32 pool: the breakdown's KV bytes default to it
    assert [s["step"] for s in steps] == list(range(1, run.stats["num_steps"] + 1))
    assert {s["kind"] for s in steps} <= KINDS
    assert {"span_job", "probe", "decode"} <= {s["kind"] for s in steps}
    # The warmed span's job runs first, alone.
    jobs = [s for s in steps[: len(steps) // 2] if s["kind"] == "span_job"]
    assert sum(s["span_job_tokens"] for s in jobs) == run.warmed["computed_tokens"] > 0
    assert sum(s["extend_tokens"] for s in steps) >= run.stats["computed_prefill_tokens"]
    assert sum(s["probe_tokens"] for s in steps) > 0
    # Each request samples its first token at the end of its prefill, the others in decode rows.
    assert sum(s["decode_reqs"] for s in steps) == sum(o["meta_info"]["completion_tokens"] - 1 for o in run.outs)
    for s in steps:
        assert s["new_tokens"] == s["extend_tokens"] + s["decode_reqs"] > 0
        assert s["extend_tokens"] >= s["span_job_tokens"] + s["probe_tokens"]
        assert s["context_tokens"] >= s["new_tokens"] and s["attn_pairs"] >= s["new_tokens"]
        assert s["kind"] != "decode" or s["extend_tokens"] == 0
        assert s["kind"] != "mixed" or (s["extend_tokens"] > 0 and s["decode_reqs"] > 0)
        assert s["kind"] not in ("prefill", "span_job", "probe") or s["decode_reqs"] == 0
        assert s["cuda_graph"] is False  # CPU
        for name in ("idle_s", "loop_s", "host_s", "launch_s", "settle_s", "device_s"):
            assert s[name] >= 0, name
        assert s["host_s"] >= s["launch_s"]
    assert steps[0]["device_gap_s"] is None and all(s["device_gap_s"] >= 0 for s in steps[1:])
    assert all(a["t"] <= b["t"] for a, b in zip(steps, steps[1:]))


def test_the_breakdown_adds_up_to_the_trace(traced, tmp_path):
    path, _ = traced
    _, steps = _lines(path)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"duration": 1e6, "completed": 3, "total_output_tokens": 12}) + "\n")
    out = tmp_path / "breakdown.json"
    report = bench_serving_breakdown.main([str(path), "--bench-result", str(bench), "--out", str(out),
                                           "--tflops", "790", "--hbm-tbps", "4.25", "--params-b", "8.03"])
    assert json.loads(out.read_text())["steps"] == report["steps"] == len(steps)  # the window holds every step
    assert report["ceilings"]["kv_bytes"] == 4  # the trace's pool
    assert out.with_suffix(".png").stat().st_size > 0
    device = sum(s["device_s"] for s in steps)
    assert report["device_busy_s"] == pytest.approx(device)
    assert sum(k["device_s"] for k in report["device_by_kind"].values()) == pytest.approx(device)
    assert report["device_idle_s"] == pytest.approx(sum(s["device_gap_s"] for s in steps[1:]), abs=1e-6)
    assert report["wall_s"] == pytest.approx(report["device_busy_s"] + report["device_idle_s"])
    assert report["beyond_bound_s"] == pytest.approx(sum(report["beyond_bound"].values()))
    assert report["bound_s"] > 0
    assert report["bound_share_of_wall"] == pytest.approx(report["bound_s"] / report["wall_s"])
    # Off CUDA the forward runs on the host: the device idle is all host time, charged exactly.
    assert report["device_idle_by_cause"]["other"] == pytest.approx(0, abs=1e-5)
    assert report["tokens"]["extend"] == sum(s["extend_tokens"] for s in steps)
    assert report["tokens"]["decode_rows"] == sum(s["decode_reqs"] for s in steps)
    decodes = [s for s in steps if s["kind"] == "decode"]
    assert report["decode_batch_size"]["steps"] == len(decodes)
    assert sum(b["steps"] for b in report["decode_batch_size"]["histogram"]) == len(decodes)
    assert report["decode_cuda_graph_share"] == 0.0
    assert report["bench_serving"]["completed"] == 3


def test_the_last_run_of_an_appended_trace_is_read(traced, tmp_path):
    path, _ = traced
    twice = tmp_path / "twice.jsonl"
    text = path.read_text()
    header, first, *_ = text.splitlines()
    twice.write_text(text + header + "\n" + first + "\n")
    runs = bench_serving_breakdown.read_runs(str(twice))
    assert len(runs) == 2 and len(runs[-1][1]) == 1


def test_each_data_parallel_replica_traces_into_its_own_file():
    one = ServerArgs(step_trace="t.jsonl")
    assert for_replica(one, 0) is one
    assert for_replica(ServerArgs(step_trace="t.jsonl", dp_size=2), 1).step_trace == "t.jsonl.dp1"
    assert for_replica(ServerArgs(dp_size=2), 1).step_trace is None


class FakeEvent:
    """A CUDA event on a scripted device clock: each record takes the next time of `clock`; it has passed once the
    device has reached that time (`now`), or once the host waited for it."""

    clock: list[float] = []
    now = -1.0
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self) -> None:
        self.at = FakeEvent.clock.pop(0)

    def query(self) -> bool:
        return self.at <= FakeEvent.now

    def synchronize(self) -> None:
        FakeEvent.waits += 1
        FakeEvent.now = max(FakeEvent.now, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read before it passed"
        return (end.at - self.at) * 1e3


def test_cuda_events_are_read_once_passed_and_waited_for_only_when_idle(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "clock", [0.0, 10.0, 12.0, 20.0])  # step 1's start and end, step 2's
    monkeypatch.setattr(FakeEvent, "now", -1.0)
    monkeypatch.setattr(FakeEvent, "waits", 0)
    graphs = SimpleNamespace(num_replays={"decode": 0})
    runner = SimpleNamespace(device=SimpleNamespace(type="cuda"), graph_runner=graphs,
                             server_args=SimpleNamespace(model_path="m", tp_size=1),
                             token_to_kv_pool=SimpleNamespace(dtype=torch.bfloat16))
    out = io.StringIO()
    tracer = StepTracer(out, runner, overlap=True)
    plan = SimpleNamespace(entries=[])
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), num_decodes=2,
                            seq_lens_cpu=[5, 6], extend_seq_lens_cpu=[1, 1], positions_cpu=[4, 5])

    def call(replays: int | None, idle: bool = False) -> list[dict]:
        """One scheduler call (replays None: it runs no forward); the steps written so far."""
        tracer.call_started()
        if replays is not None:
            tracer.forward_called(plan, batch)
            graphs.num_replays["decode"] += replays
            tracer.forward_queued()
        tracer.call_ended(idle)
        return [json.loads(line) for line in out.getvalue().splitlines()[1:]]

    assert call(1) == [] and call(0) == []  # neither step's end has passed: nothing is read or waited for
    FakeEvent.now = 15.0
    steps = call(None)
    assert [s["step"] for s in steps] == [1] and FakeEvent.waits == 0
    assert steps[0]["device_s"] == pytest.approx(10.0) and steps[0]["device_gap_s"] is None
    assert steps[0]["cuda_graph"] is True and steps[0]["kind"] == "decode" and steps[0]["decode_reqs"] == 2
    steps = call(None, idle=True)  # idle: the last step is waited for
    assert FakeEvent.waits == 1 and [s["step"] for s in steps] == [1, 2]
    assert steps[1]["device_s"] == pytest.approx(8.0) and steps[1]["device_gap_s"] == pytest.approx(2.0)
    assert steps[1]["cuda_graph"] is False


def test_attention_is_bounded_at_its_own_peak():
    """With fp8 weights the GEMMs run at twice the bf16 peak, attention still at the bf16 one: the compute bound
    charges each at its own."""
    shape = dict(hbm_tbps=4.0, params_b=1.0, weight_bytes=1.0, layers=2, q_heads=4, kv_heads=2, head_dim=8,
                 kv_bytes=2.0)
    step = {"new_tokens": 100, "attn_pairs": 10**6, "context_tokens": 50}
    fp8 = bench_serving_breakdown.Ceilings(tflops=2.0, attention_tflops=1.0, **shape)
    compute, memory = fp8.step_bound(step)
    assert compute == pytest.approx((2e9 * 100 / 2.0 + 4 * 2 * 4 * 8 * 1e6 / 1.0) / 1e12)
    assert memory == pytest.approx((1e9 + 2 * 2 * 2 * 8 * 2.0 * 150) / 4e12)
    assert bench_serving_breakdown.Ceilings(tflops=2.0, attention_tflops=2.0, **shape).step_bound(step)[0] < compute
