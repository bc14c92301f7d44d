"""Picks the attention backend a runner serves with. It sits apart from the backends' base (attention_backend.py),
which every backend imports, so the base never imports the backends back; the Triton and FlashInfer backends are
imported only when picked, since their kernels need packages a CPU install lacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_pic.layers.attention_backend import AttentionBackend, TorchNativeAttnBackend

if TYPE_CHECKING:
    from sglang_pic.layers.radix_attention import RadixAttention


def create_attention_backend(name: str, layer: "RadixAttention", model_config, speculative: bool) -> AttentionBackend:
    """The backend `name` for a model whose attention layers look like `layer` (FlashInfer plans with its shape
    and refuses what it cannot run: see check_flashinfer_support)."""
    if name == "torch_native":
        return TorchNativeAttnBackend()
    if name == "triton":
        from sglang_pic.layers.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    if name == "flashinfer":
        from sglang_pic.layers.flashinfer_backend import create_flashinfer_backend

        return create_flashinfer_backend(layer, model_config, speculative)
    raise ValueError(f"unknown attention backend {name!r}")
