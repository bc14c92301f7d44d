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
    """Padded torch attention (kernels/torch_native.py). A mixed batch's riding decodes are a part of their own:
    padded together with the extends, every decode would be padded to the longest extend's query rows."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        decodes = fb.num_decodes
        extends, rows = fb.batch_size - decodes, fb.input_ids.shape[0] - decodes
        bounds = [(slice(0, extends), slice(0, rows)), (slice(extends, fb.batch_size), slice(rows, rows + decodes))]
        fb.attn_metadata["parts"] = [  # (requests, their token rows, longest extend, longest context)
            (reqs, toks, max(fb.extend_seq_lens_cpu[reqs]), max(fb.seq_lens_cpu[reqs]))
            for reqs, toks in bounds
            if reqs.stop > reqs.start
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
        outs = [
            paged_attention_torch(
                q3[rows],
                k_buf,
                v_buf,
                fb.req_to_token_pool.req_to_token,
                fb.req_pool_indices[reqs],
                fb.seq_lens[reqs],
                fb.extend_start_loc[reqs] - rows.start,
                fb.extend_seq_lens[reqs],
                fb.positions[rows],
                fb.attn_lo[rows],
                layer.rotary.cos_sin_cache,
                layer.scaling,
                max_q=max_q,
                max_kv=max_kv,
            )
            for reqs, rows, max_q, max_kv in fb.attn_metadata["parts"]
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(q.shape[0], layer.num_heads * layer.v_head_dim)


def create_attention_backend(name: str) -> AttentionBackend:
    if name == "torch_native":
        return TorchNativeAttnBackend()
    if name == "triton":
        from sglang_pic.layers.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")
