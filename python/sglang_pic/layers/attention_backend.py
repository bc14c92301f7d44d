"""Attention backends: the model hands them unrotated q, k, v; they store k, v and attend with in-kernel RoPE."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from sglang_pic.kernels.torch_native import paged_attention_torch, store_kv_torch

if TYPE_CHECKING:
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One instance per model runner. `init_forward_metadata` runs once per batch, `forward` once per layer."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Precompute per-batch data shared by all layers (sizes, split plans)."""

    def warm_up(self, layer: "RadixAttention", token_to_kv_pool, req_to_token_pool) -> int:
        """Run each kernel variant the backend can pick once, so none compiles while serving; returns how many
        launches that took. Backends without compiled kernels have nothing to do."""
        return 0

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] unrotated. Writes k, v to out_cache_loc, returns [T, Hq*Dv]."""


class TorchNativeAttnBackend(AttentionBackend):
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        forward_batch.attn_metadata["max_q"] = max(forward_batch.extend_seq_lens_cpu, default=0)
        forward_batch.attn_metadata["max_kv"] = max(forward_batch.seq_lens_cpu, default=0)

    def forward(self, q, k, v, layer, forward_batch):
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        store_kv_torch(
            k_buf,
            v_buf,
            forward_batch.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
        )
        out = paged_attention_torch(
            q.view(-1, layer.num_heads, layer.head_dim),
            k_buf,
            v_buf,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            forward_batch.extend_start_loc,
            forward_batch.extend_seq_lens,
            forward_batch.positions,
            forward_batch.attn_lo,
            layer.rotary.cos_sin_cache,
            layer.scaling,
            max_q=forward_batch.attn_metadata["max_q"],
            max_kv=forward_batch.attn_metadata["max_kv"],
        )
        return out.reshape(q.shape[0], layer.num_heads * layer.v_head_dim)


def create_attention_backend(name: str) -> AttentionBackend:
    if name == "torch_native":
        return TorchNativeAttnBackend()
    if name == "triton":
        from sglang_pic.layers.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")
