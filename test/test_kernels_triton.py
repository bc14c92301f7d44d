"""Triton attention kernels on CPU, under the Triton interpreter, against a float64 reference and torch_native.

Each test asks long-lived interpreter workers (triton_worker.py, started once per module with TRITON_INTERPRET=1
before triton is imported, one per core) for its own case from triton_cases.py and asserts on the JSON it gets back,
so a case runs, fails and times out alone without each test paying a fresh torch and triton import. The module's
selected cases are queued when it starts, so every core runs one while the tests wait for theirs in turn.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from triton_worker import LIST_CASES, WorkerPool

HANG_TIMEOUT_S = 900  # per case; only catches a hang (the slowest case takes a minute or two on 2 busy cores)
# bf16 is loose because the interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}
ROW_SLACK = 4.0  # the worst (token, head) row may be this much further off than the whole


@pytest.fixture(scope="module")
def worker(request: pytest.FixtureRequest) -> Iterator[WorkerPool]:
    """One interpreter worker per core (up to 4), with the cases of this module's selected tests queued, the engine
    cases (a minute or less each) first so that no worker is left with a long one at the end."""
    if importlib.util.find_spec("triton") is None:  # only the worker and the sm_90 build import triton
        pytest.skip("triton is not installed")
    pool = WorkerPool(HANG_TIMEOUT_S, max(1, min(4, len(os.sched_getaffinity(0)))))
    names = [_case_of(item) for item in request.session.items if item.module is request.module]
    pool.prefetch(sorted(filter(None, names), key=lambda name: name not in SLOW_CASES))
    yield pool
    pool.close()


def _case_of(item: pytest.Item) -> str | None:
    """The case a test asks for: its `name` parameter."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("name") if callspec else None


ATTENTION_CASES = [
    "prefill_ragged_gqa_page1_fp32",
    "extend_prefix_mqa_dim16_page16_fp32",
    "spans_gqa_page16_fp32",
    "spans_gqa_page1_bf16",
    "spans_group3_page16_fp16",
    "spans_partial_rotary_vdim16_fp32",
    "spans_baseline_rotated_keys_fp32",
    "spans_key_splits3_fp32",
    "extend_key_splits5_bf16",
    "spans_staged_keys_page16_fp32",
    "span_scaling_key_splits3_fp32",
    "span_scaling_staged_keys_bf16",
    "prefill_staged_keys_fp32",
    "extend_staged_keys_splits3_partial_rotary_bf16",
    "decode_splits_gqa_page16_fp32",
    "decode_splits_mqa_dim16_page1_bf16",
    "decode_group3_partial_rotary_fp16",
    "decode_one_split_fp32",
    "decode_baseline_rotated_keys_fp32",
    "shared_decode_gqa_page16_fp32",
    "shared_decode_many_members_mqa_dim16_bf16",
    "shared_decode_group3_partial_rotary_fp16",
    "spans_staged_keys_fp8_e4m3_bf16",
    "extend_key_splits3_fp8_e5m2_fp32",
    "decode_splits_gqa_fp8_e4m3_bf16",
    "shared_decode_gqa_fp8_e4m3_fp32",
]


def _entry(worker: WorkerPool, name: str) -> dict:
    entry = worker.run(name)
    assert "exception" not in entry, entry.get("exception")
    assert not entry["nan"], f"{name}: output has NaN (unwritten rows or a read of a poisoned slot)"
    return entry


def _assert_close(name: str, what: str, errs: list[float], tol: float) -> None:
    whole, worst_row = errs
    assert whole < tol and worst_row < ROW_SLACK * tol, f"{name} {what}: rel err {whole:.2e}, worst row {worst_row:.2e}"


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_kernel(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    tol = TOLERANCE[entry["dtype"]]
    _assert_close(name, "vs float64 reference", entry["vs_reference"], tol)
    _assert_close(name, "vs torch_native", entry["vs_torch_native"], tol)


STORE_CASES = ["store_kv_fp32", "store_kv_bf16", "store_kv_fp8_e4m3_bf16", "store_kv_fp8_e5m2_fp32"]
STORE_ROTATED_CASES = ["store_kv_rotated_fp32", "store_kv_rotated_bf16"]
BACKEND_CASES = [
    "backend_extend_page16",
    "backend_long_prefill_page16",
    "backend_decode_page1",
    "backend_mixed_page16",
    "backend_mixed_shared_decode_page16",
]
GRAPH_PADDED = ["backend_graph_padded_extend", "backend_graph_padded_staged_prefill",
                "backend_graph_padded_staged_extend_at_context_len"]
GRAPH_CASES = [*GRAPH_PADDED, "stage_decision"]
WARM_UP_CASES = ["warm_up", "warm_up_coverage"]
KIVI_CASES = ["kivi_gqa_fp32", "kivi_group3_partial_rotary_vdim16_bf16"]
KIVI_ENGINE_CASES = ["kivi_engine"]
ENGINE_CASES = [
    "graph_replay_engine",
    "shared_decode_engine",
    "shared_decode_common_prefix_engine",
    "shared_decode_static_plan",
    "span_probe_engine",
    "span_attention_engine",
    "fp8_kv_engine",
]
SLOW_CASES = {*ENGINE_CASES, *KIVI_ENGINE_CASES, *WARM_UP_CASES} - {"shared_decode_static_plan"}


def test_every_case_is_checked(worker: WorkerPool) -> None:
    kivi = KIVI_CASES + KIVI_ENGINE_CASES
    cases = ATTENTION_CASES + STORE_CASES + STORE_ROTATED_CASES + BACKEND_CASES + GRAPH_CASES + WARM_UP_CASES
    assert set(worker.run(LIST_CASES)["cases"]) == set(cases + kivi + ENGINE_CASES)


@pytest.mark.parametrize("name", STORE_CASES)
def test_store_kv_exact(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry["others_untouched"] and entry["k_exact"] and entry["v_exact"]


@pytest.mark.parametrize("name", STORE_ROTATED_CASES)
def test_store_kv_rotated(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry["others_untouched"] and entry["v_exact"]
    # fp32 rotation vs float64: one rounding step of the pool dtype apart (the interpreter truncates to bf16).
    _assert_close(name, "keys vs reference", entry["vs_reference"], {"float32": 1e-6, "bfloat16": 8e-3}[entry["dtype"]])


@pytest.mark.parametrize("name", BACKEND_CASES)
def test_backend_matches_torch_native(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    _assert_close(name, "vs torch_native backend", entry["vs_torch_native"], TOLERANCE["float32"])
    assert entry["staged"] == (name == "backend_long_prefill_page16")


@pytest.mark.parametrize("name", KIVI_CASES)
def test_kivi_draft_kernel_matches_torch_path(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    _assert_close(name, "vs the torch KIVI path", entry["vs_torch_native"], TOLERANCE[entry["dtype"]])


@pytest.mark.slow  # two engines, the drafts of sixteen tokens under the interpreter
@pytest.mark.parametrize("name", ["kivi_engine"])
def test_kivi_drafts_through_the_kernel_in_the_engine(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry == {
        "dtype": "float32",
        "nan": False,
        "identical": True,
        "static_kivi_backend": "KiviTritonDraftBackend",
        "refreshed": True,
        "drafts_accepted_and_rejected": True,
    }


@pytest.mark.slow  # engines decoding under the interpreter
@pytest.mark.parametrize("name", ["shared_decode_engine"])
def test_shared_decode_in_the_engine_gives_the_same_tokens(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry["identical"]
    assert entry["shared_steps"] > 0 and entry["keys_saved"] > 0  # the shared kernel ran and skipped repeats
    assert entry["per_request_shared_steps"] == 0  # --disable-shared-decode keeps the per-request kernel


@pytest.mark.slow  # engines decoding under the interpreter
@pytest.mark.parametrize("name", ["shared_decode_common_prefix_engine"])
def test_shared_decode_in_the_engine_over_a_common_prefix(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry["identical"] and entry["shared_steps"] > 0


@pytest.mark.slow  # two engines, one of them tensor-parallel, under the interpreter
@pytest.mark.parametrize("name", ["fp8_kv_engine"])
def test_fp8_kv_pool_and_shared_decode_plan_through_the_triton_backend_at_tp2(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry["identical"] and entry["shared_steps"] > 0


@pytest.mark.slow  # three engines, one of them tensor-parallel, under the interpreter
@pytest.mark.parametrize("name", ["span_attention_engine"])
def test_span_attention_scaling_through_the_triton_backend_at_tp2(worker: WorkerPool, name: str) -> None:
    assert _entry(worker, name) == {"dtype": "float32", "nan": False, "identical": True, "scaled": True}


@pytest.mark.slow  # two engines prefilling under the interpreter
@pytest.mark.parametrize("name", ["span_probe_engine"])
def test_span_probe_chooses_alike_through_the_triton_backend(worker: WorkerPool, name: str) -> None:
    assert _entry(worker, name) == {
        "dtype": "float32", "nan": False, "probed": 4, "same_choice": True, "identical": True,
    }


@pytest.mark.slow  # two engines prefilling under the interpreter
@pytest.mark.parametrize("name", ["graph_replay_engine"])
def test_graph_replays_give_the_eager_engine_tokens(worker: WorkerPool, name: str) -> None:
    assert _entry(worker, name) == {
        "dtype": "float32", "nan": False, "identical": True, "decode_replays": True, "padded_to_context": True,
    }


@pytest.mark.parametrize("name", ["shared_decode_static_plan"])
def test_shared_decode_static_plan_keeps_the_live_rows(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    assert entry["fits"] and entry["spare_rows"] > 0  # the grid covers more item rows than the step has
    _assert_close(name, "vs float64 reference", entry["vs_reference"], TOLERANCE["float32"])
    assert entry["padded_zero"]


@pytest.mark.parametrize("name", GRAPH_PADDED)
def test_padded_extend_graph_inputs_keep_the_live_rows(worker: WorkerPool, name: str) -> None:
    entry = _entry(worker, name)
    _assert_close(name, "vs torch_native backend", entry["vs_torch_native"], TOLERANCE["float32"])
    assert entry["writes_only_own_and_dummy_slots"] and entry["key_splits"]
    assert entry["staged"] == ("staged" in name)


@pytest.mark.parametrize("name", ["stage_decision"])
def test_keys_are_staged_while_the_workspace_fits(worker: WorkerPool, name: str) -> None:
    assert worker.run(name) == {
        "no_keys": False, "prefill_8k": True, "at_bound": True, "over_bound": False, "few_queries": False
    }


@pytest.mark.parametrize("name", ["warm_up"])
def test_warm_up_launches_every_variant_writing_only_the_dummy_slot(worker: WorkerPool, name: str) -> None:
    entry = worker.run(name)
    # CPU has one tile: a few query rows in-kernel; past FEW_QUERY_ROWS rows in-kernel and staged; each whole and
    # split; then decode
    assert entry == {
        "launches": 7, "variants": 6, "staged_variants": 2, "only_dummy_slot_written": True,
        "short_context_launches": 3, "long_context_launches": 5,
    }


@pytest.mark.parametrize("name", ["warm_up_coverage"])
def test_warm_up_covers_every_extend_variant_of_gpu_batches(worker: WorkerPool, name: str) -> None:
    entry = worker.run(name)
    assert entry.get("num_missing") == 0, entry


@pytest.mark.slow  # a triton compile of every GPU variant
def test_kernels_compile_for_sm90() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    build = Path(__file__).with_name("triton_sm90_build.py")
    proc = subprocess.run([sys.executable, str(build)], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failures = {k: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items() if v is not None}
    assert not failures, "\n".join(f"{k}:\n{v}" for k, v in failures.items())
