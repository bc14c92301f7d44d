"""Builds the kernels' GPU configurations for sm_90 without a GPU (not under the interpreter): catches what the
interpreter cannot, such as layouts, tl.dot shape rules and loop-carried types. Run as a script by
test_kernels_triton.py; prints one JSON line {variant: null or the error}."""

from __future__ import annotations

import json
import traceback


def main() -> None:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_pic.kernels import decode_attention as da
    from sglang_pic.kernels import extend_attention as ea
    from sglang_pic.kernels import kivi_decode as kd
    from sglang_pic.kernels import shared_decode as sd
    from sglang_pic.kernels import stage_keys as st
    from sglang_pic.kernels import store_kv as sk
    from sglang_pic.kernels.rope import HeadSplit

    cuda = torch.device("cuda")
    float_ptrs = {"q_ptr", "k_ptr", "v_ptr", "k_buf_ptr", "v_buf_ptr", "out_ptr", "ws_ptr"}
    fp32_ptrs = {"mid_o_ptr", "mid_lse_ptr", "span_temp_ptr", "span_scale_ptr", "span_lse_ptr"}

    def build(kernel, params: dict, dtype: str, pool: str | None = None, table: str = "fp32") -> None:
        """`pool`: the KV pool's element type when it differs from `dtype` (the store's inputs come in it too);
        `table`: the cos/sin table's."""
        consts = dict(params)
        options = {"num_warps": consts.pop("num_warps"), "num_stages": consts.pop("num_stages", 1)}
        pool_ptrs = {"k_buf_ptr", "v_buf_ptr"} | ({"k_ptr", "v_ptr"} if kernel is sk._store_kv_kernel else set())

        def arg_type(name: str) -> str:
            if name in consts:
                return "constexpr"
            if pool is not None and name in pool_ptrs:
                return "*" + pool
            if name in float_ptrs:
                return "*" + dtype
            if name == "cos_sin_ptr":
                return "*" + table
            if name in fp32_ptrs:
                return "*fp32"
            return "*i64" if name.endswith("_ptr") else ("fp32" if name == "qk_scale" else "i32")

        names = kernel.arg_names
        signature = {n: arg_type(n) for n in names}
        # Torch tensors and these strides are 16-aligned; the JIT would specialize on that the same way.
        aligned = [i for i, n in enumerate(names) if signature[n][0] == "*" or n.startswith("stride")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        src = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    report = {}
    split = HeadSplit(128, 128, 128)
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for rotated in (False, True):
            ext = ea.extend_kernel_params(32, 8, split, torch_dtype, cuda, rotated)
            dec, merge = da.decode_kernel_params(32, 8, split, torch_dtype, cuda, rotated)
            variants = {
                "extend": (ea._extend_attention_kernel, ext),
                "decode": (da._decode_split_kernel, dec),
                "decode_merge": (da._decode_merge_kernel, merge),
                "store_kv": (sk._store_kv_kernel, sk.store_kernel_params(8, split, rotate=rotated)),
            }
            if not rotated:
                staged = ea.extend_kernel_params(32, 8, split, torch_dtype, cuda, False, keys_staged=True)
                variants["extend_staged"] = (ea._extend_attention_kernel, staged)
                short = ea.extend_kernel_params(32, 8, split, torch_dtype, cuda, False, keys_staged=True,
                                                max_extend_len=1024, max_keys=1024)
                variants["extend_staged_short_context"] = (ea._extend_attention_kernel, short)
                variants["stage_keys"] = (st._stage_keys_kernel, st.stage_kernel_params(split))
                for span_pass in (1, 2):  # APE's log-sum-exp pass per span group and its attention pass
                    variants[f"extend_span_pass{span_pass}"] = (ea._extend_attention_kernel,
                                                                {**ext, "SPAN_PASS": span_pass})
                kivi = kd.kivi_kernel_params(32, 8, 128, 128, 128, 32, 32, torch_dtype, cuda)[0]
                variants["kivi_decode"] = (kd._kivi_split_kernel, kivi)
                shared, shared_merge = sd.shared_decode_kernel_params(32, 8, split, torch_dtype, cuda)
                variants["shared_decode"] = (sd._shared_decode_kernel, shared)
                variants["shared_decode_merge"] = (sd._merge_partials_kernel, shared_merge)
                for tokens in (9, 60):  # both few-query tiles (x 4 heads: up to 128 rows, up to 256)
                    few = ea.extend_kernel_params(32, 8, split, torch_dtype, cuda, False, max_extend_len=tokens)
                    variants[f"extend_{tokens}_tokens"] = (ea._extend_attention_kernel, few)
            for name, (kernel, params) in variants.items():
                key = f"{name}_{dtype}_{'prerotated' if rotated else 'position_free'}"
                try:
                    build(kernel, params, dtype)
                    report[key] = None
                except Exception:
                    report[key] = traceback.format_exc()[-3000:]
    # fp8 pools under bf16 queries: every kernel that reads or writes the pool (staged keys go to a bf16 workspace)
    for pool, pool_dtype in (("fp8e4nv", torch.float8_e4m3fn), ("fp8e5", torch.float8_e5m2)):
        decode = da.decode_kernel_params(32, 8, split, torch.bfloat16, cuda, False, pool_dtype=pool_dtype)[0]
        fp8_variants = {
            "extend": (ea._extend_attention_kernel, ea.extend_kernel_params(32, 8, split, torch.bfloat16, cuda, False)),
            "extend_staged": (ea._extend_attention_kernel, ea.extend_kernel_params(
                32, 8, split, torch.bfloat16, cuda, False, keys_staged=True)),
            "decode": (da._decode_split_kernel, decode),  # fp16 tiles (decode_tile_dtype)
            "store_kv_staged": (sk._store_kv_kernel, sk.store_kernel_params(8, split, rotate=False, stage=True)),
            "stage_keys": (st._stage_keys_kernel, st.stage_kernel_params(split)),
            "shared_decode": (sd._shared_decode_kernel,
                              sd.shared_decode_kernel_params(32, 8, split, torch.bfloat16, cuda)[0]),
        }
        for name, (kernel, params) in fp8_variants.items():
            key = f"{name}_bf16_{pool}_pool"
            try:
                build(kernel, params, "bf16", pool, "fp16" if name == "decode" else "fp32")
                report[key] = None
            except Exception:
                report[key] = traceback.format_exc()[-3000:]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
