"""The small-M fp8-weight matmul kernel (kernels/fp8_gemv.py) against x.float() @ (w.float() * scale[:, None]).T.

On CPU the kernel runs under the Triton interpreter, in a child process (interpreted_child.py) that prints one JSON
report. Both the kernel and the reference multiply exactly in float32 (a bf16 or fp16 value times an e4m3 value has
at most 15 significant bits) and differ in the order of their float32 sums and where the scale enters, so each output
must lie within one unit of its dtype's last place of the reference (the interpreter narrows by truncation, the GPU
to nearest) plus (2K + 4) * 2^-24 * sum_k |x w scale|: both float32 summation bounds, and the scale's roundings.
The cases run under small launch shapes that take several steps over K with a masked tail, unsplit and split, the
rows padded to tl.dot's 16 or 32; on CPU each case under the shapes that its point needs (the interpreter takes
~0.1 s a launch), on the GPU every case under every shape, the benchmark's included.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from interpreted_child import interpreted_report

from sglang_pic.layers.quant_fp8 import FP8, quantize_rows

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
N, K = 40, 200  # neither a multiple of the blocks (16 rows, 64 columns)
# (block_n, block_k, num_warps, min_programs, max_k_steps): 3 row blocks of 16; K in 4 steps of 64, the last of 8
SMALL_CONFIGS = {
    "plain": (16, 64, 4, 0, 0),
    "split": (16, 64, 4, 6, 0),  # 3 row blocks want 2 runs of K: 2 steps, then a step and the tail
    "split_k": (16, 64, 4, 0, 1),  # at most a step per program: 4 runs of K, the last the tail alone
}
BENCH_CONFIGS = ("n32_k256_split", "n32_k256_split1056", "n32_k256_split_k12")  # fp8_gemv.CONFIGS' names
# case -> the launch shapes it runs under on CPU
CPU_RUNS = {
    "m1": ("plain", "split", "split_k"),
    "m3": ("plain", "split", *BENCH_CONFIGS),
    "m16": ("plain", "split", "split_k"),
    "m40": ("plain",),  # 3 x 2 programs, the 6 that "split" asks for: it would not split
    "strided_5": ("plain",),
    "tokens_2x3": ("split",),
    "no_rows": ("plain",),
    "extreme_weight": ("plain", "split"),
}
CASES = tuple(CPU_RUNS)


def make_case(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, fp8 weight [N, K], float32 scales [N]) of one case, drawn from a generator seeded by its name."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    w, scale = quantize_rows(torch.randn(N, K, generator=gen) * 0.05)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).to(dtype)

    if name in ("m1", "m3", "m16", "m40"):  # one token; a few, the broadcast path; tl.dot's 16; two tiles of 32
        return randn(int(name[1:]), K), w, scale
    if name == "strided_5":  # rows with a stride larger than their length, as a slice of a fused projection
        return randn(5, K + 100)[:, :K], w, scale
    if name == "tokens_2x3":  # leading dims kept
        return randn(2, 3, K), w, scale
    if name == "no_rows":
        return randn(2, 0, K), w, scale
    if name == "extreme_weight":  # rows of +-448, of subnormals (2^-9 .. 7 * 2^-9) and zeros of both signs, mixed
        bits = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.int32)
        magnitude = bits & 0x7F
        bits[:10] = (bits[:10] & 0x80) | 0x7E  # +-448
        bits[10:20] = (bits[10:20] & 0x80) | (magnitude[10:20] % 8)  # subnormals and +-0
        bits[20:] = torch.where(magnitude[20:] == 0x7F, bits[20:] & 0x80, bits[20:])  # no NaN: +-0 instead
        scale = torch.rand(N, generator=gen) * 0.02
        scale[10:20] *= 1e4  # outputs of the subnormal rows near 1
        return randn(3, K), bits.to(torch.uint8).view(FP8), scale
    raise KeyError(name)


def compare(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> dict:
    """Shape, dtype and the worst |got - reference| over its bound (see the module docstring; at most 1 passes)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    dequantized = w.float() * scale[:, None]
    reference = (rows @ dequantized.T).reshape(*x.shape[:-1], w.shape[0])
    magnitudes = (rows.abs().double() @ dequantized.abs().double().T).reshape(reference.shape)
    finfo = torch.finfo(x.dtype)
    bound = finfo.eps * reference.abs().double() + finfo.smallest_normal * finfo.eps + (2 * K + 4) * 2**-24 * magnitudes
    error = (got.cpu().double() - reference.double()).abs()
    return {
        "shape": list(got.shape),
        "want_shape": list(reference.shape),
        "dtype": str(got.dtype),
        "worst": float((error / bound).max()) if error.numel() else 0.0,
    }


def run_cases(device: str, runs: dict[str, tuple[str, ...]]) -> dict:
    """Each case under its launch shapes (small ones by name, else the benchmark's), on `device`."""
    from sglang_pic.kernels.fp8_gemv import CONFIGS, GemvConfig, fp8_weight_matmul

    configs = {**{name: GemvConfig(*shape) for name, shape in SMALL_CONFIGS.items()}, **CONFIGS}
    report = {}
    for dtype_name, dtype in DTYPES.items():
        for case, config_names in runs.items():
            x, w, scale = make_case(case, dtype)
            for name in config_names:
                got = fp8_weight_matmul(x.to(device), w.to(device), scale.to(device), configs[name])
                report[f"{case}_{name}_{dtype_name}"] = compare(got, x, w, scale)
    return report


def _child_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from sglang_pic.kernels.fp8_gemv import CONFIGS, fp8_weight_matmul

    report = run_cases("cpu", CPU_RUNS)
    report["bench_configs"] = list(CONFIGS)
    try:
        fp8_weight_matmul(torch.ones(1, K), *make_case("m1", torch.bfloat16)[1:])
        report["rejects_float32"] = False
    except ValueError:
        report["rejects_float32"] = True
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    return interpreted_report(__file__)


def assert_close(result: dict, label: str, dtype: str) -> None:
    assert result["shape"] == result["want_shape"] and result["dtype"] == f"torch.{dtype}", f"{label}: {result}"
    assert result["worst"] <= 1, f"{label}: {result}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_kernel_is_the_float32_reference(report: dict, case: str, dtype: str) -> None:
    results = {k: v for k, v in report.items() if k.startswith(f"{case}_") and k.endswith(f"_{dtype}")}
    assert len(results) == len(CPU_RUNS[case])
    for label, result in results.items():
        assert_close(result, label, dtype)


def test_every_benchmark_shape_is_tested(report: dict) -> None:
    assert report["bench_configs"] == list(BENCH_CONFIGS)


def test_default_launch_splits_llama_8b_linears_as_measured() -> None:
    """The default shape gives each Llama-3-8B linear the split that measured fastest on an H100 at 1-16 rows:
    q|k|v, o and down split toward 528 programs (whole steps per run), gate|up (896 programs of 16 steps) in two
    runs of 8 steps."""
    from sglang_pic.kernels.fp8_gemv import CONFIGS, DEFAULT_CONFIG, k_split

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for m in (1, 16):
        got = {name: k_split(DEFAULT_CONFIG, m, *shape) for name, shape in shapes.items()}
        assert got == {"qkv": (3, 6), "o": (4, 4), "gate_up": (2, 8), "down": (5, 12)}, got
        assert {name: k_split(CONFIGS["n32_k256_split"], m, *shape) for name, shape in shapes.items()} == {
            **got, "gate_up": (1, 16)}
    assert k_split(DEFAULT_CONFIG, 40, 40, 200) == (1, 1)


def test_float32_activations_are_refused(report: dict) -> None:
    assert report["rejects_float32"]


# ---- GPU ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_is_the_float32_reference() -> None:
    """The compiled kernel under every launch shape, within the same bound (tl.dot on tensor cores)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton's float8e4nv needs compute capability 8.9+")
    every_shape = (*SMALL_CONFIGS, *BENCH_CONFIGS)
    for label, result in run_cases("cuda", {case: every_shape for case in CASES}).items():
        assert_close(result, label, label.rsplit("_", 1)[1])


if __name__ == "__main__" and "--child" in sys.argv:
    _child_main()
