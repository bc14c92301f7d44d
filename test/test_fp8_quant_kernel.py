"""The per-token fp8 quantization kernel (kernels/quant_fp8.py) against `quantize_rows`, its torch reference.

On CPU the kernel runs under the Triton interpreter, in a child process (interpreted_child.py) that prints one JSON
report. The kernel rounds onto the e4m3 grid itself and only then casts, so the interpreter checks all of its
arithmetic as is: Triton 3.9's interpreter cast from float32 to float8e4nv is wrong (ties go away from zero, and a
rounding that carries into an odd exponent loses that exponent's bit: 0.0302734375 becomes 0.015625, not 0.03125;
about 1% of random values), but exact on values already on the grid. The `every_bf16` and `ties` cases quantize
under a scale of exactly 1, so every finite bf16 value up to 448 and every tie between e4m3 values is rounded as is.
The GPU tests check the compiled kernel against the same reference, and the W8A8 linear that feeds it to _scaled_mm.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreted_child import interpreted_report

from sglang_pic.layers.quant_fp8 import (
    FP8,
    FP8_MAX,
    MIN_AMAX,
    activation_quantized_linear,
    fp8_linear_reference,
    quantize_activations,
    quantize_rows,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CASES = ("random_5x100", "one_row_4096", "two_blocks_5000", "mlp_row_14336", "strided_3x96", "tokens_2x3x64",
         "special_rows", "ties", "every_bf16", "no_rows")


def fp8_midpoints() -> torch.Tensor:
    """Every value halfway between two neighbouring positive e4m3 values, subnormals included (exact in bf16, fp16
    and fp32): quantized under a scale of 1 they are all ties."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, NaN (127) left out
    return (grid[:-1] + grid[1:]) / 2


def make_case(name: str, dtype: torch.dtype) -> torch.Tensor:
    """The input of one case, drawn from a generator seeded by its name."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 3

    if name == "random_5x100":  # K not a multiple of the (power of two) block
        return randn(5, 100).to(dtype)
    if name == "one_row_4096":  # a decode step of one token
        return randn(1, 4096).to(dtype)
    if name == "two_blocks_5000":  # a full block and a masked tail
        return randn(3, 5000).to(dtype)
    if name == "mlp_row_14336":  # Llama-3-8B's down_proj input, four blocks
        return randn(2, 14336).to(dtype)
    if name == "strided_3x96":  # rows with a stride larger than their length, as a slice of a fused projection
        return randn(3, 128).to(dtype)[:, :96]
    if name == "tokens_2x3x64":  # leading dims kept
        return randn(2, 3, 64).to(dtype)
    if name == "special_rows":
        huge = torch.finfo(dtype).max / 2
        rows = randn(7, 200)
        rows[0] = 0.0  # amax 0: the scale is MIN_AMAX / 448 and every value 0
        rows[1] = -0.0  # the sign of zero survives
        rows[2] = rows[2] * 1e-14  # amax below MIN_AMAX: the scale is clamped
        rows[3] = rows[3].sign() * huge  # values near the dtype's max: large scales, all at +-448
        rows[4, :100] *= huge / 10  # small values beside a huge one: fp8 subnormals and underflow to zero
        rows[5, 7] = 1e4  # one outlier
        rows[6] = -rows[6].abs()  # amax from a negative value
        return rows.to(dtype)
    if name == "ties":  # a scale of exactly 1 (amax 448) and every tie between fp8 values, both signs
        mids = fp8_midpoints()
        return torch.cat([torch.tensor([FP8_MAX]), mids, -mids]).reshape(1, -1).to(dtype)
    if name == "every_bf16":  # a scale of exactly 1 and every finite bf16 value of magnitude up to 448
        values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        values = values[values.abs() <= FP8_MAX]
        return torch.cat([torch.tensor([FP8_MAX]), values]).reshape(1, -1).to(dtype)
    if name == "no_rows":
        return randn(0, 64).to(dtype)
    raise KeyError(name)


def compare(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """fp8 bytes and float32 scales, each equal or not, and how many fp8 values differ."""
    (q, scale), (q_ref, scale_ref) = got, want
    differ = q.cpu().view(torch.uint8) != q_ref.cpu().view(torch.uint8)
    return {
        "shapes": [list(q.shape), list(scale.shape)] == [list(q_ref.shape), list(scale_ref.shape)],
        "dtypes": [str(q.dtype), str(scale.dtype)],
        "contiguous": q.is_contiguous(),
        "values_differ": int(differ.sum()),
        "scales_equal": torch.equal(scale.cpu(), scale_ref.cpu()),
    }


def ties_to_even() -> int:
    """How many ties of the ties case round down to even, i.e. where ties away from zero would be wrong: proof the
    case tests the rounding mode."""
    mids = fp8_midpoints()
    return int((mids.to(FP8).float() < mids).sum())


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from sglang_pic.kernels.quant_fp8 import quantize_rows_fp8

    report = {"ties_to_even": ties_to_even()}
    for dtype_name, dtype in DTYPES.items():
        for name in CASES:
            x = make_case(name, dtype)
            report[f"{name}_{dtype_name}"] = compare(quantize_rows_fp8(x, MIN_AMAX), quantize_rows(x))
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    return interpreted_report(__file__)


def assert_bit_exact(result: dict, label: str) -> None:
    assert result["shapes"] and result["contiguous"], f"{label}: {result}"
    assert result["dtypes"] == ["torch.float8_e4m3fn", "torch.float32"], f"{label}: {result}"
    assert result["values_differ"] == 0 and result["scales_equal"], f"{label}: {result}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_kernel_is_quantize_rows_bit_for_bit(report: dict, case: str, dtype: str) -> None:
    assert_bit_exact(report[f"{case}_{dtype}"], f"{case}_{dtype}")


def test_ties_case_tells_the_rounding_modes_apart(report: dict) -> None:
    assert report["ties_to_even"] > 20


# ---- GPU ----------------------------------------------------------------------------------------------------------


def needs_fp8() -> None:
    """Triton's float8e4nv casts and _scaled_mm both need compute capability 8.9+."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_kernel_is_the_cpu_reference_bit_for_bit(dtype: str) -> None:
    """The compiled kernel (IEEE division, float32 rounding onto the e4m3 grid, the cast) gives quantize_rows' CPU
    numbers. torch's own quantize_rows on CUDA may put a scale one unit of the last place off (it multiplies by a
    rounded 1/448)."""
    needs_fp8()
    from sglang_pic.kernels.quant_fp8 import quantize_rows_fp8

    for name in CASES:
        x = make_case(name, DTYPES[dtype])
        got = quantize_rows_fp8(x.cuda(), MIN_AMAX)
        assert_bit_exact(compare(got, quantize_rows(x)), f"{name}_{dtype}")
        _, cuda_scale = quantize_rows(x.cuda())
        torch.testing.assert_close(got[1], cuda_scale, rtol=2**-23, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["one_row_4096", "mlp_row_14336", "strided_3x96", "tokens_2x3x64"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_activation_quantized_linear_feeds_the_kernel_to_scaled_mm(case: str, dtype: str) -> None:
    """The W8A8 linear on CUDA (one token, an MLP row, strided rows, leading dims) is _scaled_mm over the CPU
    reference's quantized activations, exactly, and within fp8's error of the float linear (the bound
    test_fp8_weights.py uses)."""
    needs_fp8()
    x = make_case(case, DTYPES[dtype])
    rows = x.reshape(-1, x.shape[-1])
    gen = torch.Generator().manual_seed(7)
    q, scale = (t.cuda() for t in quantize_rows(torch.randn(384, x.shape[-1], generator=gen) * 0.02))
    out = activation_quantized_linear(*quantize_activations(rows.cuda()), q, scale)
    xq, x_scale = quantize_rows(rows)
    expected = torch._scaled_mm(xq.cuda(), q.t(), scale_a=x_scale.cuda().unsqueeze(1), scale_b=scale.unsqueeze(0),
                                out_dtype=torch.bfloat16)
    assert out.shape == (rows.shape[0], 384) and torch.equal(out, expected)
    reference = fp8_linear_reference(rows, q.cpu(), scale.cpu()).float()
    assert (out.cpu().float() - reference).norm() / reference.norm() < 0.06


if __name__ == "__main__" and "--child" in sys.argv:
    _child_main()
