"""RoPE tables. Keys live unrotated in the KV pool; attention backends rotate queries and keys from these tables."""

from __future__ import annotations

import math

import torch

from sglang_pic.model_config import rope_scaling_type


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _linear_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    return inv_freq / scaling["factor"]


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(scaling: dict) -> float:
    """YaRN's cos/sin multiplier: logits grow by its square, offsetting the entropy a longer window adds."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_inv_freq(rotary_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dims that turn more than beta_fast times within the original window keep their
    frequency, dims that turn fewer than beta_slow times are divided by `factor`, a linear ramp blends those between.

    Computed in float32 as transformers and vLLM do, so the frequencies are exactly theirs; the caller still forms
    the angles in float64. A zero or missing beta means the paper's default, as in transformers.
    """
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ValueError(f"yarn rope_scaling needs {key!r}")
    factor = float(scaling["factor"])
    old_ctx = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_turning(rotations: float) -> float:
        """The (fractional) dim index whose wavelength fits `rotations` times into the original window."""
        return rotary_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-dim ramp would divide by zero
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


class RotaryEmbedding:
    """Holds `cos_sin_cache` [max_position, rotary_dim] in float32: cos in the first half, sin in the second.

    Rotation is the neox / rotate_half form used by Llama, Qwen and Mistral checkpoints in HF format.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim))
        rope_type = rope_scaling_type(rope_scaling)
        # Scales cos and sin alike, so both rotated q and k carry it: the kernels need nothing beyond this table.
        self.attention_factor = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            inv_freq = _linear_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "yarn":
            inv_freq = _yarn_inv_freq(self.rotary_dim, base, rope_scaling).to(torch.float64)
            self.attention_factor = _yarn_attention_factor(rope_scaling)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_factor
        self.cos_sin_cache = table.to(torch.float32).to(device)
        self._kernel_tables = {torch.float32: self.cos_sin_cache}

    def kernel_table(self, kv_dtype: torch.dtype) -> torch.Tensor:
        """The table the Triton kernels get, converted once. They rotate keys in the table's dtype, so it comes
        in the KV cache's dtype; except bf16 on CPU, where the Triton interpreter's bf16 arithmetic is wrong (it
        works on the raw bits) and fp32 is used."""
        if kv_dtype == torch.bfloat16 and self.cos_sin_cache.device.type == "cpu":
            kv_dtype = torch.float32
        if kv_dtype not in self._kernel_tables:
            self._kernel_tables[kv_dtype] = self.cos_sin_cache.to(kv_dtype)
        return self._kernel_tables[kv_dtype]
