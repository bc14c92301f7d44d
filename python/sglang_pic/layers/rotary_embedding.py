"""RoPE tables. Keys live unrotated in the KV pool; attention backends rotate queries and keys from these tables."""

from __future__ import annotations

import math

import torch


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
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            inv_freq = _linear_inv_freq(inv_freq, rope_scaling)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)
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
