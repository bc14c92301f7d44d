"""FP8 (e4m3) linear math: weights per output channel, activations per token, both scaled by amax / 448.

The served path (`fp8_linear`) quantizes each token's activations, multiplies the fp8 operands with fp32
accumulation, applies both scales and rounds to bf16: on CUDA sm_89+ through `torch._scaled_mm` with row-wise
scales, elsewhere (CPU, and shapes _scaled_mm refuses) by the same steps in fp32, whose products of fp8 values are
exact, so CPU tests check the numbers a GPU serves up to summation order. At decode sizes (up to GEMV_MAX_M rows of
bf16/fp16) it leaves the activations unquantized instead (W8A16): a decode step is bound by weight bytes, and one
Triton kernel (kernels/fp8_gemv.py) reads each fp8 weight byte once where _scaled_mm at one row was slower than the
bf16 GEMV it replaces; the CPU does the same math in fp32. `fp8_linear_reference` is the float linear over the
dequantized weights, the target the fp8 error is measured against. Activations are quantized by `quantize_rows` on
CPU and, on CUDA, by one Triton kernel (kernels/quant_fp8.py) that gives the same fp8 values and scales bit for bit
in one kernel instead of four or five, or by the RMSNorm / SiLU kernel that produced them (kernels/norm_act.py,
handing over Fp8Rows), with the same numbers. Values are clamped before the rounding to fp8 because CUDA turns
overflow into NaN where the CPU saturates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12  # an all-zero row still gets a finite scale (and quantizes to zeros)
GEMM_OUT_DTYPE = torch.bfloat16  # row-wise _scaled_mm writes bf16 on every GPU that has it
# _scaled_mm needs both dims of the weight to be multiples of 16.
GEMM_ALIGN = 16
# Rows up to which bf16/fp16 activations stay unquantized (W8A16, decode): on one H100 the kernel's Llama-3-8B layer
# took 110 us against _scaled_mm's 143 at 16 rows, and lost at 32 (160 against 137).
GEMV_MAX_M = 16
WEIGHT_ONLY_DTYPES = (torch.bfloat16, torch.float16)
# Checkpoint tensors of static activation scales, unused: activations are quantized per token at run time.
ACTIVATION_SCALE_NAMES = ("input_scale", "input_scale_ub")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (fp8 [..., K], float32 scales [...]): each row over its own amax / 448. For a weight [N, K]
    that is per output channel, for activations [M, K] per token. The activations' CPU path and the reference of
    the CUDA kernel (kernels/quant_fp8.py); weights on any device at load. Its division amax / 448 is a true one on
    CPU, while torch on CUDA multiplies by a rounded 1/448 (a scale may then be one unit of the last place apart)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32)
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    return (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def channel_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight_scale as one float32 scale per output row: [rows, 1] or [rows] per channel, a
    one-element tensor per tensor (repeated, so the packed parts of q|k|v or gate|up keep their own scales)."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows)
    if scale.shape in ((rows,), (rows, 1)):
        return scale.float().reshape(rows)
    raise ValueError(f"weight_scale of shape {tuple(scale.shape)} is neither per tensor nor per channel of {rows} rows")


@functools.cache
def _has_fp8_gemm(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def require_fp8_gemm(device: torch.device) -> None:
    """Refuse a GPU without fp8 tensor cores, where every fp8 linear would dequantize its whole weight."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _has_fp8_gemm(index):
        major, minor = torch.cuda.get_device_capability(index)
        raise ValueError(
            f"fp8 weights need a GPU of compute capability 8.9+ (Ada, Hopper); this one is sm_{major}{minor}"
        )


def _uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return x.is_cuda and n % GEMM_ALIGN == 0 and k % GEMM_ALIGN == 0 and _has_fp8_gemm(x.device.index)


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized per token by the op that produced them (kernels/norm_act.py), for an fp8
    linear: values [..., K] in fp8, float32 scales [...], and the dtype the activations had (the linear's output's)."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def quantizes_activations(rows: int, dtype: torch.dtype) -> bool:
    """Whether fp8_linear quantizes `rows` activations of `dtype` (else W8A16), so their producer may do it."""
    return rows > GEMV_MAX_M or dtype not in WEIGHT_ONLY_DTYPES


def fp8_linear(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ the fp8 weight [N, K] (float32 scales [N]) + bias, in x's dtype, as served."""
    if isinstance(x, Fp8Rows):
        lead, dtype = x.values.shape[:-1], x.dtype
        out = activation_quantized_linear(x.values.reshape(-1, x.values.shape[-1]), x.scales.reshape(-1), weight,
                                          weight_scale)
    else:
        lead, dtype = x.shape[:-1], x.dtype
        rows = x.reshape(-1, x.shape[-1])
        if quantizes_activations(rows.shape[0], x.dtype):
            out = activation_quantized_linear(*quantize_activations(rows), weight, weight_scale)
        else:
            out = weight_only_linear(rows, weight, weight_scale)
    out = out.to(dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def weight_only_linear(rows: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """rows [M, K] (bf16/fp16) @ the dequantized weight, float32 sums rounded to rows' dtype: W8A16."""
    if rows.is_cuda:
        from sglang_pic.kernels.fp8_gemv import fp8_weight_matmul

        return fp8_weight_matmul(rows, weight, weight_scale)
    return ((rows.float() @ weight.float().t()) * weight_scale).to(rows.dtype)


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] per token: one Triton kernel on CUDA, quantize_rows (the same numbers) elsewhere."""
    if rows.is_cuda:
        from sglang_pic.kernels.quant_fp8 import quantize_rows_fp8

        return quantize_rows_fp8(rows, MIN_AMAX)
    return quantize_rows(rows)


def activation_quantized_linear(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """Per-token fp8 activations [M, K] (float32 scales [M]) times the fp8 weight, both scales applied, in bf16:
    W8A8."""
    if _uses_scaled_mm(xq, weight):
        return torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0), out_dtype=GEMM_OUT_DTYPE
        )
    acc = xq.float() @ weight.float().t()
    return (acc * x_scale.unsqueeze(1) * weight_scale.unsqueeze(0)).to(GEMM_OUT_DTYPE)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The float linear over the dequantized weight, activations unquantized: what fp8_linear approximates."""
    out = x.float() @ dequantize_rows(weight, weight_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
