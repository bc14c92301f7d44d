"""Weight quantization settings: `--quantization` values and the fp8 checkpoint formats loaded as stored.

An fp8 checkpoint is recognized by its config.json's `quantization_config`; its weights and scales load as they
are (layers/quant_fp8.py holds the math). Both formats below store each linear weight in float8_e4m3fn with a
`weight_scale` per output channel ([out, 1]) or per tensor (a scalar); activation scales a checkpoint may carry
(`input_scale`, `input_scale_ub`) go unused, since activations are always quantized per token at run time, which is
at least as fine. Any other quantization_config is refused rather than loaded as if it were dense.
"""

from __future__ import annotations

from typing import Any

QUANTIZATIONS = ("fp8",)

# compressed-tensors weight strategies whose scales are one per output row or one per tensor.
_CHANNEL_STRATEGIES = ("channel", "tensor")


def check_quantization(value: str | None) -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {value!r}")


def _check_compressed_tensors(config: dict[str, Any]) -> None:
    """Only the float-quantized format (named by the config or each group) with 8-bit float weights scaled per
    channel or per tensor."""
    if config.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not supported; use --kv-cache-dtype fp8_e4m3 instead")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        layout = group.get("format") or config.get("format")
        if layout != "float-quantized":
            raise ValueError(f"compressed-tensors format {layout!r} is not supported; only float-quantized")
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in _CHANNEL_STRATEGIES:
            raise ValueError(
                f"compressed-tensors group {name!r} has weights {kind[0]} {kind[1]}-bit by {kind[2]}; only 8-bit "
                f"float weights scaled by {' or '.join(_CHANNEL_STRATEGIES)} are supported"
            )


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """'fp8' for a checkpoint stored in a supported fp8 format (compressed-tensors float-quantized, fbgemm_fp8),
    None for an unquantized one; ValueError naming the format otherwise."""
    config = hf_config.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(config)
    elif method != "fbgemm_fp8":
        raise ValueError(
            f"checkpoints quantized with {method!r} are not supported; fp8 checkpoints in the compressed-tensors "
            "(float-quantized) and fbgemm_fp8 formats are, and --quantization fp8 quantizes a bf16/fp16 one at load"
        )
    return "fp8"


def resolve_quantization(requested: str | None, hf_config: dict[str, Any]) -> str | None:
    """What the model runs: an fp8 checkpoint is served in fp8 whatever was asked; else `--quantization`."""
    check_quantization(requested)
    return checkpoint_quantization(hf_config) or requested
