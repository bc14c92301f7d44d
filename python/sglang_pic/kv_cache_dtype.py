"""KV-cache storage dtypes: SGLang's `--kv-cache-dtype` names, per-layer scales, and the rounding of new keys and
values into the pool.

An fp8 pool halves the bytes decode reads per token and doubles the tokens a pool holds. Keys are stored
unrotated, so one fp8 rounding serves every offset a span is read at. Each layer's keys and values get a scale, a
power of two fixed at start from one forward over fixed tokens (model_runner.py): the pool stores x / scale.
Without it (SGLang's default of 1.0 when a checkpoint has none) Qwen2.5-0.5B's first-layer values, of about 0.03,
fall into e4m3's subnormals. A power of two divides exactly, so the scale folds into the softmax scale (keys) and
the attention output (values) outside the kernels. Values are clamped to the format's finite range, then rounded
to nearest even in torch rather than in a kernel, because the Triton interpreter rounds fp8 wrongly and the CPU
tests must see the GPU's bytes. Kernels widen pool tiles right after loading them: to the model's dtype, except
decode under bf16, which widens them to fp16 (`decode_tile_dtype`).
"""

from __future__ import annotations

import math

import torch

# "auto" (None) is the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype `--kv-cache-dtype name` (a key of KV_CACHE_DTYPES) selects for a model computing in
    `model_dtype`."""
    return KV_CACHE_DTYPES[name] or model_dtype


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the pool dtype; fp8 saturates at the format's largest finite value instead of overflowing."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def decode_tile_dtype(pool_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype the decode kernel widens tiles of a `pool_dtype` pool to, rotates keys in and multiplies in, for
    queries in `dtype`: `dtype`, except fp16 for an fp8 pool under bf16. Every e4m3 and e5m2 value is an fp16 one,
    reached with one packed instruction per two values; bf16 takes one more conversion per value (on an H100 the
    kernel took 1.22x the time with bf16 tiles)."""
    if pool_dtype in FP8_DTYPES and dtype == torch.bfloat16:
        return torch.float16
    return dtype


SCALE_HEADROOM = 2.0  # calibration's largest magnitude maps to at most half the format's largest value


def power_of_two_scale(amax: float, dtype: torch.dtype) -> float:
    """The scale an fp8 pool stores x / scale with, so that the calibrated largest |x| `amax` lands between a
    quarter and a half of the format's largest value; 1.0 for other dtypes or an all-zero calibration."""
    if dtype not in FP8_DTYPES or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * SCALE_HEADROOM / torch.finfo(dtype).max))
