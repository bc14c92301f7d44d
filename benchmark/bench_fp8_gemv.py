"""The small-M fp8-weight matmul kernel (kernels/fp8_gemv.py) on one GPU under each of its launch shapes, against
per-token quantization + torch._scaled_mm (what --quantization fp8 serves) and the bf16 linear, for Llama-3-8B's
linears at decode sizes, timed as CUDA graph replays.

Each timed call runs the linear once per copy of its weight, enough copies to pass --rotate-mb (200 MB, four times
an H100's L2) and the time is per copy: consecutive layers' weights come from memory, not L2, as in a decode step
(--rotate-mb 0 times one weight again and again, like bench_fp8_quant.py). GB/s is the kernel's weight bytes (fp8
values and float32 scales) over its time. Before timing, each shape's output is checked against the float32
reference x.float() @ (w.float() * scale[:, None]).T on the GPU.

  python benchmark/bench_fp8_gemv.py --out build/fp8_gemv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from sglang_pic.kernels.fp8_gemv import CONFIGS, fp8_weight_matmul
from sglang_pic.kernels.quant_fp8 import quantize_rows_fp8
from sglang_pic.layers.quant_fp8 import MIN_AMAX, quantize_rows

# (name, N, K) of Llama-3-8B's linears at tp 1
LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def time_us(fn, weights: list[tuple[torch.Tensor, ...]]) -> float:
    """Median microseconds of fn(*weight) per weight, the calls over all weights replayed as one CUDA graph."""
    return do_bench_cudagraph(lambda: [fn(*w) for w in weights], rep=50, return_mode="median") * 1e3 / len(weights)


def copies(t: tuple[torch.Tensor, ...], rotate_bytes: int) -> list[tuple[torch.Tensor, ...]]:
    """t and clones of it, enough that their bytes reach rotate_bytes."""
    size = sum(x.numel() * x.element_size() for x in t)
    return [t] + [tuple(x.clone() for x in t) for _ in range(1, max(1, -(-rotate_bytes // size)))]


def scaled_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The served fp8 linear: per-token quantization, then the row-wise scaled fp8 GEMM."""
    xq, x_scale = quantize_rows_fp8(x, MIN_AMAX)
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale.unsqueeze(1), scale_b=w_scale.unsqueeze(0),
                            out_dtype=torch.bfloat16)


def errors(got: torch.Tensor, reference: torch.Tensor) -> dict:
    """Largest absolute difference, and that over the reference's largest magnitude."""
    err = float((got.float() - reference).abs().max())
    return {"max_abs_err": err, "max_rel_err": err / float(reference.abs().max())}


def bench_linear(name: str, n: int, k: int, sizes: list[int], rotate_bytes: int) -> list[dict]:
    """One row per M: each launch shape's time, GB/s and error, _scaled_mm's time and error, the bf16 time."""
    w_bf16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    w, w_scale = quantize_rows(w_bf16)
    dequantized = w.float() * w_scale[:, None]
    fp8_weights = copies((w, w_scale), rotate_bytes)
    bf16_weights = copies((w_bf16,), rotate_bytes)
    rows = []
    for m in sizes:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        reference = x.float() @ dequantized.T
        row = {"m": m, "linear": name, "n": n, "k": k, "fp8_copies": len(fp8_weights),
               "scaled_mm": errors(scaled_mm(x, w, w_scale), reference)}
        for config_name, config in CONFIGS.items():
            us = time_us(functools.partial(fp8_weight_matmul, x, config=config), fp8_weights)
            row[config_name] = {"us": us, "gbps": (n * k + n * 4) / us / 1e3,
                                **errors(fp8_weight_matmul(x, w, w_scale, config), reference)}
        row["scaled_mm"]["us"] = time_us(functools.partial(scaled_mm, x), fp8_weights)
        row["bf16_us"] = time_us(functools.partial(F.linear, x), bf16_weights)
        row["best"] = min(CONFIGS, key=lambda c: row[c]["us"])
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--rotate-mb", type=int, default=200)
    ap.add_argument("--out", default="build/fp8_gemv.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [r for name, n, k in LINEARS for r in bench_linear(name, n, k, args.sizes, args.rotate_mb << 20)]
    results = {
        "device": torch.cuda.get_device_name(),
        "rotate_mb": args.rotate_mb,
        "configs": {name: dataclasses.asdict(config) for name, config in CONFIGS.items()},
        "timings": rows,
    }
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'M':>3} {'linear':>8} " + " ".join(f"{c:>18}" for c in CONFIGS)
          + f" {'GB/s':>6} {'rel err':>8} {'fp8 mm':>7} {'bf16':>7}  (us)")
    for r in sorted(rows, key=lambda r: r["m"]):
        best = r[r["best"]]
        print(f"{r['m']:>3} {r['linear']:>8} " + " ".join(f"{r[c]['us']:>18.1f}" for c in CONFIGS)
              + f" {best['gbps']:>6.0f} {max(r[c]['max_rel_err'] for c in CONFIGS):>8.1e}"
              f" {r['scaled_mm']['us']:>7.1f} {r['bf16_us']:>7.1f}")


if __name__ == "__main__":
    main()
