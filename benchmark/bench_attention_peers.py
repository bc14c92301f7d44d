"""Our Triton attention against FlashInfer, the library SGLang serves with, at bench_attention_kernels.py's shapes.

Four variants per case, on one set of inputs and timed in the same interleaved rounds (CUDA graph replays, cold
L2, median; see bench_attention_kernels.py):
- `flashinfer_prerotated`: FlashInfer's standard layout (keys rotated at store time, `pos_encoding_mode="NONE"`),
  decode with FlashInfer's own page size (`--page-size`) and with pages of one slot (what a position-free pool
  needs: spans end mid-page), prefill (FA2) with one-slot pages;
- `flashinfer_rope`: `ROPE_LLAMA` over unrotated keys with one-slot pages: FlashInfer as the engine's FlashInfer
  backend runs it (layers/flashinfer_rows.py gives the rows);
- `triton_position_free` and `triton_prerotated`: bench_attention_kernels.py's numbers for our kernels.
Decode reports GB/s of KV read, extends TFLOP/s over visible query-key pairs, both against the ceilings measured in
the same run. Each case also checks that FlashInfer's ROPE_LLAMA output matches our position-free kernel's (the
same attention; FlashInfer's fast sin/cos differ in the last bits).

  python benchmark/bench_attention_peers.py --out benchmark/results/attention_peers_h200.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from statistics import median

import torch

import bench_attention_kernels as bak
from graph_timing import ceilings, interleaved_ms, spread_pct

DECODE_GOAL = {"batches": [32, 64, 128, 256], "contexts": [8192, 16384, 32768]}
QUICK = {"batches": [32, 256], "contexts": [8192, 32768], "prefill": [1024, 8192]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmark/results/attention_peers.json"))
    p.add_argument("--quick", action="store_true", help="2x2 decode shapes and two prefill lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(bak.DTYPES), default="bf16")
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-kv-tokens", type=int, default=9 * 2**20)
    args = p.parse_args(argv)
    args.batches = QUICK["batches"] if args.quick else DECODE_GOAL["batches"]
    args.contexts = QUICK["contexts"] if args.quick else DECODE_GOAL["contexts"]
    args.prefill = QUICK["prefill"] if args.quick else bak.FULL["prefill"]
    return args


class FlashInferCase:
    """FlashInfer wrappers planned for one PagedBatch: `run(mode, page_size)` attends its queries."""

    def __init__(self, batch, args: argparse.Namespace, decode: bool) -> None:
        import flashinfer

        from sglang_pic.layers.flashinfer_backend import HeadShape, decode_on_tensor_cores
        from sglang_pic.layers.flashinfer_rows import decode_rows, extend_rows

        self.fi, self.batch, self.decode, self.args = flashinfer, batch, decode, args
        table, pool_rows = batch.req_to_token, batch.req_pool_indices.tolist()
        if decode:
            self.rows = decode_rows(table, pool_rows, batch.seq_lens_cpu)
        else:
            self.rows = extend_rows(table, pool_rows, batch.positions.tolist(), batch.attn_lo.tolist(),
                                    batch.extend_seq_lens_cpu)
        self.dtype = bak.DTYPES[args.dtype]
        self.tensor_cores = decode_on_tensor_cores(HeadShape(args.heads, args.kv_heads, args.head_dim, args.head_dim,
                                                             batch.sm_scale))

    def _pages(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode rows over whole pages (plain decode requests hold whole pages but the last)."""
        b = self.batch
        lens = b.seq_lens_cpu
        npages = [(n + page_size - 1) // page_size for n in lens]
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(npages, dtype=torch.int32), 0, out=indptr[1:])
        rows = b.req_pool_indices.tolist()
        pages = [b.req_to_token[r, : n * page_size : page_size] // page_size for r, n in zip(rows, npages)]
        last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32, device=bak.DEVICE)
        return indptr, torch.cat(pages).to(torch.int32), last

    def runner(self, rope: bool, page_size: int = 1):
        """A wrapper planned for these rows and its run closure, which writes `out` (returned with it)."""
        a, b, rows = self.args, self.batch, self.rows
        mode = dict(pos_encoding_mode="ROPE_LLAMA" if rope else "NONE", rope_theta=10000.0, sm_scale=b.sm_scale,
                    q_data_type=self.dtype, kv_data_type=self.dtype)
        heads = (a.kv_heads, a.head_dim)
        kv = (b.k_buffer.view(-1, page_size, *heads), b.v_buffer.view(-1, page_size, *heads))
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=bak.DEVICE)  # holds the plan: one per wrapper
        if self.decode:
            pages = (rows.kv_indptr, rows.kv_indices, rows.kv_last_page_len) if page_size == 1 \
                else self._pages(page_size)
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=self.tensor_cores)
            w.plan(*pages, a.heads, a.kv_heads, a.head_dim, page_size, **mode)
        else:
            w = self.fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            w.plan(rows.qo_indptr, rows.kv_indptr, rows.kv_indices, rows.kv_last_page_len, a.heads, a.kv_heads,
                   a.head_dim, 1, causal=True, **mode)
        out = torch.empty_like(b.q)
        return (lambda: w.run(b.q, kv, out=out)), out


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: median(t) for name, t in times.items()}


def bench_decode(args: argparse.Namespace, batch_size: int, context: int) -> dict:
    from paged_batch import decode

    from sglang_pic.kernels.decode_attention import alloc_decode_buffers, num_kv_splits

    batch = bak._make_batch(args, [decode(context)] * batch_size, seed=batch_size + context)
    sms = torch.cuda.get_device_properties(bak.DEVICE).multi_processor_count
    splits = num_kv_splits(batch_size, args.kv_heads, sms)
    own = num_kv_splits(batch_size, args.kv_heads, sms, resident_per_sm=bak.PRE_ROTATED_PROGRAMS_PER_SM)
    ours = batch.poisoned_output()

    def triton(keys_rotated: bool, n: int):
        buffers = alloc_decode_buffers(batch_size, args.heads, args.head_dim, n, batch.q.device)
        return lambda: batch.run_decode(n, keys_rotated, out=ours, buffers=buffers)

    fns = {"triton_position_free": triton(False, splits)}
    fns.update({f"triton_prerotated_{n}": triton(True, n) for n in sorted({splits, own})})
    error = {}
    for name, rope, page in (("flashinfer_prerotated", False, args.page_size), ("flashinfer_prerotated_p1", False, 1),
                             ("flashinfer_rope", True, 1)):
        fns[name], out = FlashInferCase(batch, args, decode=True).runner(rope, page)
        if rope:
            fns["triton_position_free"]()
            fns[name]()
            error[name] = float((out.float() - ours.float()).abs().max())
    times = interleaved_ms(fns, args.rep_ms, args.rounds)
    ms = summarize(times)
    pre = min((k for k in ms if k.startswith("triton_prerotated_")), key=ms.get)
    ms["triton_prerotated"] = ms.pop(pre)
    for k in [k for k in ms if k.startswith("triton_prerotated_")]:
        ms.pop(k)
    kv_bytes = batch_size * context * args.kv_heads * 2 * args.head_dim * bak.DTYPES[args.dtype].itemsize
    return {
        "kind": "decode", "batch": batch_size, "context": context, "ms": ms,
        "gbps": {k: kv_bytes / v / 1e6 for k, v in ms.items()},
        "position_free_vs_flashinfer_pct": 100.0 * (ms["triton_position_free"] / ms["flashinfer_prerotated"] - 1),
        "rope_max_abs_diff": error, "noise_pct": spread_pct(times),
    }


def bench_extend(args: argparse.Namespace, name: str, specs: list) -> dict:
    """Attention alone and the step (store, staging where the engine stages, attention) per variant. FlashInfer's
    steps use our store kernels (SGLang's FlashInfer backend has its own KV store too); its pre-rotated step leaves
    out rotating the queries, which a standard engine does in a kernel of its own."""
    from sglang_pic.kernels.stage_keys import should_stage_keys
    from sglang_pic.kernels.store_kv import store_kv, store_kv_rotated

    batch = bak._make_batch(args, specs, seed=len(name))
    ours = batch.poisoned_output()
    staged = should_stage_keys(sum(batch.seq_lens_cpu), batch.k_buffer, batch.query_rows(), batch.q.dtype)
    new_kv = (batch.out_cache_loc, batch.k_new, batch.v_new)
    case = FlashInferCase(batch, args, decode=False)
    fi_pre, _ = case.runner(rope=False)
    fi_rope, fi_out = case.runner(rope=True)

    def store_free() -> None:
        store_kv(batch.k_buffer, batch.v_buffer, *new_kv, batch.kernel_cos_sin)

    def store_pre() -> None:
        store_kv_rotated(batch.k_buffer, batch.v_buffer, *new_kv, batch.positions, batch.kernel_cos_sin)

    def triton_free() -> None:
        batch.run_extend(False, out=ours, stage=False)

    fns = {
        "triton_position_free": triton_free,
        "triton_prerotated": lambda: batch.run_extend(True, out=ours),
        "flashinfer_prerotated": fi_pre,
        "flashinfer_rope": fi_rope,
        "step_triton_position_free": (lambda: batch.run_extend(False, out=ours, stage=True)) if staged
        else (lambda: (store_free(), triton_free())),
        "step_triton_prerotated": lambda: (store_pre(), batch.run_extend(True, out=ours)),
        "step_flashinfer_prerotated": lambda: (store_pre(), fi_pre()),
        "step_flashinfer_rope": lambda: (store_free(), fi_rope()),
    }
    triton_free()
    fi_rope()
    error = float((fi_out.float() - ours.float()).abs().max())
    times = interleaved_ms(fns, args.rep_ms, args.rounds)
    ms = summarize(times)
    pairs = sum(p - lo + 1 for s in specs for p, lo in zip(s.positions, s.attn_lo))
    flops = 4 * args.heads * args.head_dim * pairs
    return {
        "kind": "extend", "case": name, "requests": len(specs), "new_tokens": sum(batch.extend_seq_lens_cpu),
        "staged": staged, "ms": ms, "tflops": {k: flops / v / 1e9 for k, v in ms.items()},
        "position_free_vs_flashinfer_pct": 100.0 * (ms["triton_position_free"] / ms["flashinfer_prerotated"] - 1),
        "step_position_free_vs_flashinfer_pct":
            100.0 * (ms["step_triton_position_free"] / ms["step_flashinfer_prerotated"] - 1),
        "rope_max_abs_diff": {"flashinfer_rope": error}, "noise_pct": spread_pct(times),
    }


def main(argv: list[str] | None = None) -> int:
    import flashinfer

    args = parse_args(argv)
    torch.set_grad_enabled(False)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer.__version__,
        "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
        "ceilings": ceilings(args.rep_ms), "rows": [],
    }
    print(json.dumps(report["ceilings"]), flush=True)
    for bs in args.batches:
        for ctx in args.contexts:
            if bs * ctx > args.max_kv_tokens:
                continue
            row = bench_decode(args, bs, ctx)
            report["rows"].append(row)
            print(f"decode b{bs} x {ctx}: " + " ".join(f"{k} {v:.0f}" for k, v in row["gbps"].items())
                  + f" GB/s; ours vs FlashInfer {row['position_free_vs_flashinfer_pct']:+.1f}%", flush=True)
            torch.cuda.empty_cache()
    for name, specs in bak.extend_cases(args.prefill).items():
        row = bench_extend(args, name, specs)
        report["rows"].append(row)
        print(f"{name}: " + " ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items())
              + f" TFLOP/s; ours vs FlashInfer {row['position_free_vs_flashinfer_pct']:+.1f}%", flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
