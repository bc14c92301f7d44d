"""The span adapter's shrink-and-join kernel (kernels/row_lora.py) on CPU under the Triton interpreter, against the
torch ops of RowLora's CPU path; and on CUDA (marked gpu), compiled, at Llama-3-8B widths.

As in test_norm_act_kernels.py, TRITON_INTERPRET must be set before triton is imported, so the interpreted checks
run in a child process that prints one JSON report.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from interpreted_child import interpreted_report

# The copied columns are exact. The down-projection is a float32 sum of products rounded once, as F.linear's: only
# the order of the sum differs, so at most one unit of the last place of the output dtype.
TOLERANCE = {"float32": 1e-5, "float16": 2**-10, "bfloat16": 2**-7}
# rows, in, rank, programs aimed at: 300 and 1000 leave a partial block of columns; a target of 2 programs makes
# two splits of 512 and 488 columns, each summed over several blocks
SHAPES = ((5, 64, 16, 512), (3, 300, 32, 512), (40, 1000, 16, 512), (40, 1000, 16, 2), (0, 64, 16, 512))


def reference(x: torch.Tensor, a: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, F.linear(x, a) * on[:, None]], dim=-1)


def cases(device: str) -> dict:
    """Per dtype and shape: whether the copied input is exact, and the down-projection's worst error relative to
    max(1, |expected|); x is a strided slice (a row stride beyond its width) and every third row is switched off."""
    from sglang_pic.kernels import row_lora

    torch.manual_seed(0)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    report = {}
    default = row_lora.TARGET_PROGRAMS
    for name, dtype in dtypes.items():
        for rows, width, rank, target in SHAPES:
            row_lora.TARGET_PROGRAMS = target
            x = (torch.randn(rows, width + 8, device=device) * 2).to(dtype)[:, :width]
            a = (torch.randn(rank, width, device=device) / width**0.5).to(dtype)
            on = (torch.arange(rows, device=device) % 3 != 0).to(dtype)
            got, want = row_lora.shrink_cat(x, a, on).double(), reference(x, a, on).double()
            err = ((got - want).abs() / want.abs().clamp(min=1.0))[:, width:]
            report[f"{rows}x{width}r{rank}t{target}_{name}"] = {
                "shape": list(got.shape),
                "want_shape": list(want.shape),
                "copied": bool(torch.equal(got[:, :width], x.double())),
                "off_rows_zero": bool((got[on == 0, width:] == 0).all()),
                "err": float(err.max()) if err.numel() else 0.0,
            }
    row_lora.TARGET_PROGRAMS = default
    return report


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(cases("cpu")))


def check(report: dict, dtype: str, expected: int) -> None:
    entries = {k: v for k, v in report.items() if k.endswith(f"_{dtype}")}
    assert len(entries) == expected
    for key, case in entries.items():
        assert case["shape"] == case["want_shape"], key
        assert case["copied"] and case["off_rows_zero"], key
        assert case["err"] <= TOLERANCE[dtype], f"{key}: {case['err']}"


@pytest.fixture(scope="module")
def report() -> dict:
    return interpreted_report(__file__)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_shrink_cat_matches_the_torch_ops(report: dict, dtype: str) -> None:
    check(report, dtype, len(SHAPES))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_cuda_shrink_cat_matches_the_torch_ops(dtype: str) -> None:
    """Compiled, at the shapes above and Llama-3-8B's inputs (4,096 and 14,336 wide) over 1 to 300 rows."""
    from sglang_pic.kernels import row_lora

    check(cases("cuda"), dtype, len(SHAPES))
    torch_dtype = getattr(torch, dtype)
    for rows in (1, 37, 300):
        for width in (4096, 14336):
            x = torch.randn(rows, width, device="cuda").to(torch_dtype)
            a = (torch.randn(16, width, device="cuda") / width**0.5).to(torch_dtype)
            on = torch.ones(rows, device="cuda", dtype=torch_dtype)
            got, want = row_lora.shrink_cat(x, a, on).double(), reference(x, a, on).double()
            assert torch.equal(got[:, :width], want[:, :width])
            assert float(((got - want).abs() / want.abs().clamp(min=1.0)).max()) <= TOLERANCE[dtype]


if __name__ == "__main__" and "--child" in sys.argv:
    _child_main()
