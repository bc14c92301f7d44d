"""How many key-range chunks the extend kernel cuts a few-query extend into (kernels/extend_attention.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from sglang_pic.kernels.extend_attention import MAX_SPLITS, num_extend_splits  # noqa: E402

H200_SMS = 132


@pytest.mark.parametrize(
    "programs, context, num_warps, splits",
    [
        (16, 16384, 8, 8),  # 60 tokens x 4 heads over 16K keys: 2 query blocks of 128 rows x 8 kv heads, 8-warp tiles
        (16, 8192, 4, 16),  # 30 tokens over 8K keys: 2 blocks of 64 rows x 8 kv heads, 4-warp tiles
        (16, 2048, 8, 4),  # a short context: chunks keep MIN_SPLIT_KEYS keys
        (1, 1 << 20, 4, MAX_SPLITS),  # one program over a long context: as many chunks as allowed
        (256, 16384, 4, 1),  # 32 requests x 8 kv heads fill the GPU already: no merge pass
        (200, 16384, 8, 1),
    ],
)
def test_extend_splits_fill_one_wave(programs: int, context: int, num_warps: int, splits: int) -> None:
    assert num_extend_splits(programs, context, H200_SMS, num_warps) == splits
