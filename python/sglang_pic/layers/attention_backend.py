"""Attention backends: the model hands them unrotated q, k, v; they store k, v and attend with in-kernel RoPE."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from sglang_pic.kernels.torch_native import paged_attention_torch, store_kv_torch

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention


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
    """Padded torch attention (kernels/torch_native.py), run once per group of requests whose new-token and context
    counts round up to the same powers of two: padded all together, a mixed batch's decodes would each cost the
    longest extend's query rows and a short span prefill the longest context (ISPS steps mix all of these)."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        groups: dict[tuple[int, int], list[int]] = {}
        for b, (q, kv) in enumerate(zip(fb.extend_seq_lens_cpu, fb.seq_lens_cpu)):
            groups.setdefault(((q - 1).bit_length(), (kv - 1).bit_length()), []).append(b)
        device = fb.req_pool_indices.device
        fb.attn_metadata["groups"] = [  # (request indices, longest extend, longest context)
            (
                torch.tensor(reqs, dtype=torch.int64, device=device),
                max(fb.extend_seq_lens_cpu[b] for b in reqs),
                max(fb.seq_lens_cpu[b] for b in reqs),
            )
            for reqs in groups.values()
        ]

    def forward(self, q, k, v, layer, forward_batch):
        fb = forward_batch
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        store_kv_torch(
            k_buf,
            v_buf,
            fb.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
        )
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q3.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        for reqs, max_q, max_kv in fb.attn_metadata["groups"]:
            paged_attention_torch(
                q3,
                k_buf,
                v_buf,
                fb.req_to_token_pool.req_to_token,
                fb.req_pool_indices[reqs],
                fb.seq_lens[reqs],
                fb.extend_start_loc[reqs],
                fb.extend_seq_lens[reqs],
                fb.positions,
                fb.attn_lo,
                layer.rotary.cos_sin_cache,
                layer.scaling,
                max_q=max_q,
                max_kv=max_kv,
                out=out,
            )
        return out.reshape(q.shape[0], layer.num_heads * layer.v_head_dim)


def create_attention_backend(name: str) -> AttentionBackend:
    if name == "torch_native":
        return TorchNativeAttnBackend()
    if name == "triton":
        from sglang_pic.layers.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")
