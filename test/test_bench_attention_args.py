"""benchmark/bench_attention_kernels.py's case selection on the CPU: --kinds picks which kinds of case would run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_attention_kernels as bench  # noqa: E402


def test_kinds_default_to_every_kind_and_parse_a_subset() -> None:
    assert bench.parse_args([]).kinds == ("decode", "extend", "store")
    assert bench.parse_args(["--kinds", "decode"]).kinds == ("decode",)
    assert bench.parse_args(["--kinds", "extend,store"]).kinds == ("extend", "store")


@pytest.mark.parametrize("text, message", [("decode,prefil", "unknown case kinds ['prefil']"), (",", "no case kinds")])
def test_bad_kinds_are_named(text: str, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--kinds", text])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(bench.torch.cuda.is_available(), reason="the plan is printed only where no GPU runs the cases")
@pytest.mark.parametrize(
    "kinds, plan",
    [
        ("decode", "would run 30 decode cases, 0 extend cases; "),
        ("extend,store", "would run 0 decode cases, 10 extend cases, the store; "),
        ("decode,extend,store", "would run 30 decode cases, 10 extend cases, the store; "),
    ],
)
def test_only_the_chosen_kinds_are_planned(kinds: str, plan: str, capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--kinds", kinds]) == 0
    assert plan in capsys.readouterr().out


@pytest.mark.parametrize("kv_dtype, pool, element_bytes", [("auto", bench.torch.bfloat16, 2),
                                                          ("fp8_e4m3", bench.torch.float8_e4m3fn, 1)])
def test_kv_dtype_sets_the_pool_the_cases_read(kv_dtype: str, pool, element_bytes: int) -> None:
    """--kv-dtype times the kernels over a pool as the server's --kv-cache-dtype holds it (the queries stay bf16)."""
    from paged_batch import decode

    args = bench.parse_args(["--kv-dtype", kv_dtype, "--heads", "4", "--kv-heads", "2", "--head-dim", "32"])
    batch = bench._make_batch(args, [decode(40)], seed=0, device="cpu")
    assert batch.k_buffer.dtype == batch.v_buffer.dtype == pool and batch.k_buffer.element_size() == element_bytes
    assert batch.q.dtype == bench.torch.bfloat16
