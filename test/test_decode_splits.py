"""The decode split count: whole waves of split-kernel programs, the fewest chunks that get there."""

from __future__ import annotations

import math

import pytest

from sglang_pic.kernels.decode_attention import MAX_SPLITS_CAP, WAVE_SLACK, num_kv_splits

H200_SMS = 132


def _wave_time(batch_size: int, kv_heads: int, splits: int, resident: int = 2) -> float:
    return math.ceil(batch_size * kv_heads * splits / (resident * H200_SMS)) / splits


@pytest.mark.parametrize(
    "batch_size,expected",
    # the fastest counts measured on the H200 (a sweep of split counts per batch size), or within 1.1% of them
    [(1, 29), (2, 15), (4, 8), (8, 4), (16, 2), (24, 4), (32, 1), (40, 3), (48, 2), (64, 1), (80, 2), (100, 3)],
)
def test_counts_measured_best_on_the_h200(batch_size: int, expected: int) -> None:
    assert num_kv_splits(batch_size, 8, H200_SMS) == expected


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("resident", [2, 3])
def test_fewest_chunks_within_the_slack_of_the_best_wave_time(kv_heads: int, resident: int) -> None:
    for batch_size in range(1, 300):
        splits = num_kv_splits(batch_size, kv_heads, H200_SMS, resident)
        times = [_wave_time(batch_size, kv_heads, s, resident) for s in range(1, MAX_SPLITS_CAP + 1)]
        assert 1 <= splits <= MAX_SPLITS_CAP
        assert times[splits - 1] <= WAVE_SLACK * min(times)
        assert all(t > WAVE_SLACK * min(times) for t in times[: splits - 1]), (batch_size, splits)


def test_batches_that_fill_the_gpu_are_not_split() -> None:
    assert [num_kv_splits(b, 8, H200_SMS) for b in (64, 128, 256)] == [1, 1, 1]
    # the pre-rotated baseline's 3 programs per SM: 99 requests x 8 kv heads are exactly two waves
    assert num_kv_splits(99, 8, H200_SMS, resident_per_sm=3) == 1
