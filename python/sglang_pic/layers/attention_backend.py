"""Attention backends: the model hands them unrotated q, k, v; they store k, v and attend with in-kernel RoPE."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV
from sglang_pic.kernels.torch_native import paged_attention_torch, store_kv_torch

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention


class AttentionBackend(ABC):
    """One instance per model runner. `init_forward_metadata` runs once per batch, `forward` once per layer."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Set forward_batch.attn_metadata to the backend's dataclass of per-batch data shared by all layers
        (sizes, split plans, request groups); a backend that needs none leaves it as it is."""

    # CUDA graphs (model_executor/cuda_graph_runner.py): whether one-request extends are captured too, and the
    # hooks around capture and replay. The defaults suit a backend whose metadata depends on the batch size only.
    captures_extends = True

    def init_cuda_graph_state(self, max_bs: int, max_request_keys: int) -> None:
        """Before any capture: buffers the graphs of up to `max_bs` decodes read, each request up to
        `max_request_keys` keys."""

    def init_forward_metadata_capture(self, forward_batch: "ForwardBatch", size: int) -> None:
        """The metadata a graph of `size` (requests in decode, tokens in extend) is captured with."""
        self.init_forward_metadata(forward_batch)

    def init_forward_metadata_replay(self, forward_batch: "ForwardBatch", size: int, padding_row: int) -> None:
        """Before a graph of `size` replays the live `forward_batch` (its padded requests read `padding_row`)."""

    def warm_up(self, layer: "RadixAttention", token_to_kv_pool, req_to_token_pool, dtype: torch.dtype) -> int:
        """Run each kernel variant the backend can pick once, with queries in the model's `dtype`, so none compiles
        while serving; returns how many launches that took. Backends without compiled kernels have nothing to do."""
        return 0

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", forward_batch: "ForwardBatch"
    ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] unrotated. Writes k, v to out_cache_loc, returns [T, Hq*Dv]."""


@dataclass(frozen=True)
class RequestGroup:
    """Requests attended together, padded to the longest of them: their indices in the batch, their table rows and
    lengths, and their new tokens' rows."""

    requests: torch.Tensor  # [n] int64
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    ext: ExtendRows

    def kv(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor) -> PagedKV:
        """The group's keys in one layer's buffers."""
        return PagedKV(k_buffer, v_buffer, req_to_token, self.req_pool_indices, self.seq_lens, self.max_seq_len)


@dataclass(frozen=True)
class TorchNativeMetadata:
    groups: list[RequestGroup]


class TorchNativeAttnBackend(AttentionBackend):
    """Padded torch attention (kernels/torch_native.py), run once per group of requests whose new-token and context
    counts round up to the same powers of two: padded all together, a mixed batch's decodes would each cost the
    longest extend's query rows and a short span prefill the longest context (ISPS steps mix all of these)."""

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        groups: dict[tuple[int, int], list[int]] = {}
        for b, (q, kv) in enumerate(zip(fb.extend_seq_lens_cpu, fb.seq_lens_cpu)):
            groups.setdefault(((q - 1).bit_length(), (kv - 1).bit_length()), []).append(b)
        fb.attn_metadata = TorchNativeMetadata([self.group(fb, reqs) for reqs in groups.values()])

    @staticmethod
    def group(fb: "ForwardBatch", requests: list[int]) -> RequestGroup:
        """The batch's requests `requests` as one padded group."""
        index = torch.tensor(requests, dtype=torch.int64, device=fb.req_pool_indices.device)
        ext = ExtendRows(fb.extend_start_loc[index], fb.extend_seq_lens[index], fb.positions, fb.attn_lo,
                         max(fb.extend_seq_lens_cpu[b] for b in requests))
        longest = max(fb.seq_lens_cpu[b] for b in requests)
        return RequestGroup(index, fb.req_pool_indices[index], fb.seq_lens[index], longest, ext)

    def forward(self, q, k, v, layer, forward_batch):
        fb = forward_batch
        pool, lid = fb.token_to_kv_pool, layer.layer_id
        k_buf, v_buf = pool.get_kv_buffer(lid)
        k, v = pool.to_storage(lid, k, v)
        store_kv_torch(
            k_buf,
            v_buf,
            fb.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
        )
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q3.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        table = fb.req_to_token_pool.req_to_token
        for group in fb.attn_metadata.groups:
            kv = group.kv(k_buf, v_buf, table)
            paged_attention_torch(q3, kv, group.ext, layer.rotary.cos_sin_cache, layer.scaling * pool.k_scale[lid],
                                  out=out, span=fb.span_scaling, requests=group.requests)
        return scale_values(out, pool.v_scale[lid]).reshape(q.shape[0], layer.num_heads * layer.v_head_dim)


def scale_values(out: torch.Tensor, v_scale: float) -> torch.Tensor:
    """Attention output over values stored as v / v_scale (MHATokenToKVPool), in the model's units."""
    return out if v_scale == 1.0 else out.mul_(v_scale)

