"""The RMSNorm and SiLU-and-mul Triton kernels on CPU, under the Triton interpreter, against the layers' torch path,
and their fp8 variants against quantizing the plain kernels' outputs.

As in test_kernels_triton.py, TRITON_INTERPRET must be set before triton is imported, so the checks run in a child
process that prints one JSON report.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreted_child import interpreted_report

# Rounding to bf16/fp16 happens at the same steps in both; what differs is the order of the float32 sum of squares,
# so a value may land one unit of the last place apart. The interpreter rounds to bf16 by truncation at each of the
# up to three rounding steps (the GPU rounds to nearest; test_kernels_gpu.py checks bf16 there within two units).
TOLERANCE = {"float32": 1e-6, "float16": 2**-10, "bfloat16": 4 * 2**-7}


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from sglang_pic.kernels.norm_act import rms_norm, silu_and_mul
    from sglang_pic.layers.activation import GatedAct
    from sglang_pic.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    report = {}

    def worst(got: torch.Tensor, want: torch.Tensor) -> float:
        """Largest difference relative to the magnitude of the expected value (at least 1)."""
        got, want = got.double(), want.double()
        return float(((got - want).abs() / want.abs().clamp(min=1.0)).max()) if want.numel() else 0.0

    for name, dtype in dtypes.items():
        for rows, cols in ((5, 64), (3, 100), (1, 4096), (0, 64)):
            norm = RMSNorm(cols, eps=1e-5).to(dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(cols) * 0.5 + 1.0)
            wide = torch.randn(rows, cols + 24, dtype=dtype) * 3
            x = wide[:, :cols]  # rows with a stride larger than their length, like a slice of a fused projection
            residual = torch.randn(rows, cols, dtype=dtype)
            with torch.no_grad():
                alone, _ = rms_norm(x, norm.weight, norm.eps)
                fused, summed = rms_norm(x, norm.weight, norm.eps, residual)
                want_fused, want_summed = norm(x, residual)
                report[f"rms_norm_{rows}x{cols}_{name}"] = {
                    "errors": [worst(alone, norm(x)), worst(fused, want_fused), worst(summed, want_summed)],
                    "shapes": [list(alone.shape), list(fused.shape), list(summed.shape)],
                }
        heads = torch.randn(4, 3, 32, dtype=dtype)  # the per-head q/k norm of Qwen3 normalizes [tokens, heads, dim]
        head_norm = RMSNorm(32).to(dtype)
        with torch.no_grad():
            per_head, _ = rms_norm(heads, head_norm.weight, head_norm.eps)
            report[f"rms_norm_per_head_{name}"] = {
                "errors": [worst(per_head, head_norm(heads))],
                "shapes": [list(per_head.shape)],
            }
        act = GatedAct("silu")
        for rows, cols in ((4, 96), (2, 2500), (0, 8)):
            x = torch.randn(rows, 2 * cols, dtype=dtype) * 4
            got = silu_and_mul(x)
            report[f"silu_and_mul_{rows}x{cols}_{name}"] = {"err": worst(got, act(x)), "shape": list(got.shape)}

    report.update(fused_fp8_cases("cpu"))
    print(json.dumps(report))


def fused_fp8_cases(device: str) -> dict[str, bool]:
    """Whether rms_norm_fp8 / silu_and_mul_fp8 on `device` give, bit for bit, the unfused kernels' outputs quantized
    by quantize_rows on CPU (the numbers kernels/quant_fp8.py gives), per case."""
    from sglang_pic.kernels.norm_act import rms_norm, rms_norm_fp8, silu_and_mul, silu_and_mul_fp8
    from sglang_pic.layers.quant_fp8 import MIN_AMAX, quantize_rows

    torch.manual_seed(1)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    report = {}

    def same_fp8(got: tuple, unfused: torch.Tensor) -> bool:
        """Equal fp8 values (bits: the sign of zero counts) and equal scales, of equal shapes."""
        want = quantize_rows(unfused.cpu())
        got = tuple(t.cpu() for t in got)
        return all(g.shape == w.shape for g, w in zip(got, want)) and torch.equal(
            got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])

    for name, dtype in dtypes.items():
        for rows, cols in ((5, 64), (3, 100), (0, 64)):
            x = torch.randn(rows, cols + 24, dtype=dtype, device=device)[:, :cols] * 3
            x[:1] = 0.0  # a row of zeros: the smallest scale, zeros of x's sign
            residual = torch.randn(rows, cols, dtype=dtype, device=device)
            weight = (torch.randn(cols, device=device) * 0.5 + 1.0).to(dtype)
            for label, res in (("alone", None), ("residual", residual)):
                out, summed = rms_norm(x, weight, 1e-5, res)
                q, scales, q_summed = rms_norm_fp8(x, weight, 1e-5, res, MIN_AMAX)
                report[f"fp8_rms_norm_{label}_{rows}x{cols}_{name}"] = (
                    same_fp8((q, scales), out)
                    and (summed is None and q_summed is None or torch.equal(summed, q_summed)))
        for rows, cols in ((4, 96), (2, 5000), (0, 8)):  # 5000: two steps of the kernel's 4096-wide block
            x = torch.randn(rows, 2 * cols, dtype=dtype, device=device) * 4
            x[:1, :cols] = -0.0  # silu(-0) * up: zeros of both signs
            report[f"fp8_silu_and_mul_{rows}x{cols}_{name}"] = same_fp8(silu_and_mul_fp8(x, MIN_AMAX), silu_and_mul(x))
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return interpreted_report(__file__)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_rms_norm_matches_the_torch_layer(report: dict, dtype: str) -> None:
    cases = {k: v for k, v in report.items() if k.startswith("rms_norm") and k.endswith(f"_{dtype}")}
    assert len(cases) == 5
    for name, case in cases.items():
        assert max(case["errors"]) <= TOLERANCE[dtype], f"{name}: {case['errors']}"
    assert report[f"rms_norm_3x100_{dtype}"]["shapes"] == [[3, 100]] * 3
    assert report[f"rms_norm_per_head_{dtype}"]["shapes"] == [[4, 3, 32]]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_silu_and_mul_matches_the_torch_layer(report: dict, dtype: str) -> None:
    cases = {k: v for k, v in report.items() if k.startswith("silu_and_mul") and k.endswith(f"_{dtype}")}
    assert len(cases) == 3
    for name, case in cases.items():
        assert case["err"] <= TOLERANCE[dtype], f"{name}: {case['err']}"
    assert report[f"silu_and_mul_2x2500_{dtype}"]["shape"] == [2, 2500]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_fused_fp8_quantization_is_the_unfused_kernels(report: dict, dtype: str) -> None:
    """rms_norm_fp8 and silu_and_mul_fp8 give, bit for bit, what quantizing the unfused kernels' outputs gives (the
    numbers fp8_linear would compute from them), and the same x + residual."""
    cases = {k: v for k, v in report.items() if k.startswith("fp8_") and k.endswith(f"_{dtype}")}
    assert len(cases) == 9
    assert all(cases.values()), [k for k, v in cases.items() if not v]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_fp8_quantization_is_the_unfused_kernels() -> None:
    """The compiled kernels: the same bit-for-bit cases."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's float8e4nv needs compute capability 8.9+")
    cases = fused_fp8_cases("cuda")
    assert len(cases) == 27 and all(cases.values()), [k for k, v in cases.items() if not v]


if __name__ == "__main__" and "--child" in sys.argv:
    _child_main()
