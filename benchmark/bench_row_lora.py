"""What a span adapter served apart from the weights (layers/row_lora.py) adds to each of Llama-3-8B's linears on
one GPU: the base linear, the served form (the Triton kernel joins [x | m x A^T], then one GEMM against [W | B]) and
the form it replaced (x A^T, the switch, then B's product added into the GEMM's output: torch.addmm), every row
switched on, timed as CUDA graph replays.

Each timed call runs the linear once per copy of its weights, enough copies to pass --rotate-mb (200 MB, four times
an H100's L2), so weights come from memory as in a step. `bound_us` is the served form's extra bytes (x read and
[x | t] written) at --hbm-tbps plus the GEMM's time scaled by its r extra input columns. Before timing, both
adapter forms are checked against x W^T + (x A^T) B^T in float32.

  python benchmark/bench_row_lora.py --out build/row_lora.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from triton.testing import do_bench_cudagraph

from sglang_pic.layers.row_lora import AdapterRows, RowLora

# (name, out, in) of Llama-3-8B's linears at tp 1
LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def time_us(fn, operands: list[tuple]) -> float:
    """Median microseconds of fn(*operand) per operand, the calls over all replayed as one CUDA graph."""
    return do_bench_cudagraph(lambda: [fn(*o) for o in operands], rep=50, return_mode="median") * 1e3 / len(operands)


def after_gemm(x: torch.Tensor, lora: RowLora, weight: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """The replaced form: the GEMM, then B (m x A^T) added into its output."""
    b = lora.joined[:, weight.shape[1]:]
    return torch.addmm(F.linear(x, weight), F.linear(x, lora.a) * on[:, None], b.t())


def bench_linear(name: str, out: int, width: int, rank: int, sizes: list[int], rotate_bytes: int,
                 hbm_tbps: float) -> list[dict]:
    rows = AdapterRows(torch.bfloat16)
    layers = []
    per_copy = (out * (width + rank)) * 2
    for _ in range(max(1, -(-rotate_bytes // per_copy))):
        weight = nn.Parameter(torch.randn(out, width, dtype=torch.bfloat16, device="cuda") * 0.02, requires_grad=False)
        a = torch.randn(rank, width, device="cuda") / width**0.5
        b = torch.randn(out, rank, device="cuda") * 0.02
        layers.append((weight, RowLora(weight, a, b, rows)))
    results = []
    for m in sizes:
        x = torch.randn(m, width, dtype=torch.bfloat16, device="cuda")
        on = torch.ones(m, dtype=torch.bfloat16, device="cuda")
        rows.set(on, True)
        weight, lora = layers[0]
        w, b = lora.joined[:, :width].float(), lora.joined[:, width:].float()
        want = x.float() @ w.T + (x.float() @ lora.a.float().T) @ b.T
        scale = float(want.abs().max())
        served = F.linear(*lora.operands(x, weight))
        row = {
            "linear": name, "m": m, "out": out, "in": width, "rank": rank, "copies": len(layers),
            "base_us": time_us(lambda w, _: F.linear(x, w), layers),
            "served_us": time_us(lambda w, lo: F.linear(*lo.operands(x, w)), layers),
            "after_gemm_us": time_us(lambda w, lo: after_gemm(x, lo, w, on), layers),
            "served_rel_err": float((served.float() - want).abs().max()) / scale,
            "after_gemm_rel_err": float((after_gemm(x, lora, weight, on).float() - want).abs().max()) / scale,
        }
        extra_bytes = m * (width * 2 + (width + lora.a.shape[0]) * 2)
        row["bound_us"] = extra_bytes / (hbm_tbps * 1e6) + row["base_us"] * lora.a.shape[0] / width
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256, 2048, 8192])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rotate-mb", type=int, default=200)
    ap.add_argument("--hbm-tbps", type=float, default=3.35, help="the card's memory bandwidth (H100 3.35, H200 4.8)")
    ap.add_argument("--out", default="build/row_lora.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    timings = [r for name, out, width in LINEARS
               for r in bench_linear(name, out, width, args.rank, args.sizes, args.rotate_mb << 20, args.hbm_tbps)]
    layer = {}
    for m in args.sizes:
        mine = [r for r in timings if r["m"] == m]
        layer[m] = {k: sum(r[k] for r in mine) for k in ("base_us", "served_us", "after_gemm_us", "bound_us")}
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rank": args.rank, "timings": timings,
                   "per_layer": layer}, f, indent=1)
    print(f"{'M':>5} {'linear':>8} {'base':>9} {'served':>9} {'after':>9} {'bound':>8} {'+served':>8} {'+after':>8}"
          f" {'err':>8}  (us)")
    for r in sorted(timings, key=lambda r: r["m"]) + [dict(v, m=m, linear="layer") for m, v in layer.items()]:
        base = r["base_us"]
        print(f"{r['m']:>5} {r['linear']:>8} {base:>9.1f} {r['served_us']:>9.1f} {r['after_gemm_us']:>9.1f}"
              f" {r['bound_us']:>8.1f} {r['served_us'] / base - 1:>8.1%} {r['after_gemm_us'] / base - 1:>8.1%}"
              f" {r.get('served_rel_err', 0):>8.1e}")


if __name__ == "__main__":
    main()
