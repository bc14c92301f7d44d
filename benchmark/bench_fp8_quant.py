"""Per-token fp8 activation quantization on one GPU: torch's `quantize_rows` against the Triton kernel, alone and in
front of _scaled_mm for Llama-3-8B's linears, next to the bf16 linear. Decode sizes (M <= 128) are timed as CUDA
graph replays, as the engine runs them; prefill sizes as plain launches.

  python benchmark/bench_fp8_quant.py --out build/fp8_quant.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from sglang_pic.kernels.quant_fp8 import quantize_rows_fp8
from sglang_pic.layers.quant_fp8 import MIN_AMAX, quantize_rows

# (name, N, K) of Llama-3-8B's linears at tp 1
LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def time_us(fn, m: int) -> float:
    """Median microseconds: graph replays for decode sizes, launches otherwise."""
    if m <= 128:
        return do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale.unsqueeze(1), scale_b=w_scale.unsqueeze(0),
                            out_dtype=torch.bfloat16)


def check(m: int, k: int) -> dict:
    """Fresh random bf16 rows (and a zero row): the kernel against the CPU reference, and torch on CUDA against it."""
    x = torch.randn(m, k, dtype=torch.bfloat16) * 3
    x[0] = 0
    q, scale = quantize_rows_fp8(x.cuda(), MIN_AMAX)
    q_ref, scale_ref = quantize_rows(x)
    q_cuda, scale_cuda = quantize_rows(x.cuda())
    return {
        "kernel_values_differ": int((q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).sum()),
        "kernel_scales_differ": int((scale.cpu() != scale_ref).sum()),
        "torch_cuda_scales_differ": int((scale_cuda.cpu() != scale_ref).sum()),
        "torch_cuda_scales_are_times_rounded_reciprocal": bool(torch.equal(
            scale_cuda.cpu(), torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32)
            .clamp(min=MIN_AMAX) * torch.tensor(1 / 448, dtype=torch.float32))),
        "rows": m,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 128, 8192])
    ap.add_argument("--out", default="build/fp8_quant.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    checks = [check(m, k) for m in (1, 4096) for k in (4096, 14336)]
    results = {"device": torch.cuda.get_device_name(), "checks": checks}
    rows = []
    for m in args.sizes:
        for name, n, k in LINEARS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w_bf16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            w, w_scale = quantize_rows(w_bf16)
            row = {
                "m": m, "linear": name, "n": n, "k": k,
                "quant_torch_us": time_us(lambda: quantize_rows(x), m),
                "quant_kernel_us": time_us(lambda: quantize_rows_fp8(x, MIN_AMAX), m),
                "fp8_torch_us": time_us(lambda: scaled_mm(*quantize_rows(x), w, w_scale), m),
                "fp8_kernel_us": time_us(lambda: scaled_mm(*quantize_rows_fp8(x, MIN_AMAX), w, w_scale), m),
                "bf16_us": time_us(lambda: F.linear(x, w_bf16), m),
            }
            # bytes the kernel must move: x read once, fp8 written, scales
            row["kernel_gbps"] = (m * k * 3 + m * 4) / row["quant_kernel_us"] / 1e3
            rows.append(row)
            del x, w_bf16, w, w_scale
    results["timings"] = rows
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results["checks"]))
    print(f"{'M':>5} {'linear':>8} {'quant torch':>11} {'quant kern':>10} {'GB/s':>6} {'fp8 torch':>9} "
          f"{'fp8 kern':>8} {'bf16':>8}   (us)")
    for r in rows:
        print(f"{r['m']:>5} {r['linear']:>8} {r['quant_torch_us']:>11.1f} {r['quant_kernel_us']:>10.1f} "
              f"{r['kernel_gbps']:>6.0f} {r['fp8_torch_us']:>9.1f} {r['fp8_kernel_us']:>8.1f} {r['bf16_us']:>8.1f}")


if __name__ == "__main__":
    main()
