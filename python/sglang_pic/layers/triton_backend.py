"""GPU attention backend: fused store of unrotated k/v, then Triton extend or flash-decoding kernels with RoPE
applied inside attention from logical positions.

Per-batch sizes come from the host-side lists of the ForwardBatch, so `forward` never synchronizes. In decode
the grid depends only on the batch size and the pool's kv-head count (see `num_kv_splits`), which keeps a captured
CUDA graph valid for any context lengths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_pic.kernels.decode_attention import alloc_decode_buffers, decode_attention_fwd, num_kv_splits
from sglang_pic.kernels.extend_attention import extend_attention_fwd
from sglang_pic.kernels.store_kv import store_kv
from sglang_pic.layers.attention_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.model_executor.forward_batch import ForwardBatch

CPU_NUM_SMS = 4  # only the Triton interpreter runs on CPU tensors; any small value works there


class TritonAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self._num_sms: int | None = None

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = CPU_NUM_SMS
        return self._num_sms

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        meta = forward_batch.attn_metadata
        if forward_batch.forward_mode.is_decode():
            device = forward_batch.seq_lens.device
            kv_heads = forward_batch.token_to_kv_pool.head_num
            meta["max_kv_splits"] = num_kv_splits(forward_batch.batch_size, kv_heads, self._sm_count(device))
            meta["decode_buffers"] = None  # allocated by the first layer, shared by all layers of the batch
        else:
            meta["max_extend_len"] = max(forward_batch.extend_seq_lens_cpu, default=0)
            meta["max_seq_len"] = max(forward_batch.seq_lens_cpu, default=0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        cos_sin = layer.rotary.kernel_table(k_buf.dtype)
        store_kv(
            k_buf,
            v_buf,
            forward_batch.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
            cos_sin,
        )
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        if forward_batch.forward_mode.is_decode():
            mid_o, mid_lse = self._decode_buffers(forward_batch, layer, q.device)
            decode_attention_fwd(
                q3,
                k_buf,
                v_buf,
                out,
                forward_batch.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                cos_sin,
                layer.scaling,
                mid_o,
                mid_lse,
            )
        else:
            extend_attention_fwd(
                q3,
                k_buf,
                v_buf,
                out,
                forward_batch.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.extend_start_loc,
                forward_batch.extend_seq_lens,
                forward_batch.positions,
                forward_batch.attn_lo,
                cos_sin,
                layer.scaling,
                forward_batch.attn_metadata["max_extend_len"],
                max_seq_len=forward_batch.attn_metadata["max_seq_len"],
                num_sms=self._sm_count(q.device),
            )
        return out.view(q3.shape[0], layer.num_heads * layer.v_head_dim)

    @staticmethod
    def _decode_buffers(
        forward_batch: "ForwardBatch", layer: "RadixAttention", device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        meta = forward_batch.attn_metadata
        buffers = meta["decode_buffers"]
        if buffers is None or buffers[0].shape[1:] != (layer.num_heads, meta["max_kv_splits"], layer.v_head_dim):
            buffers = alloc_decode_buffers(
                forward_batch.batch_size, layer.num_heads, layer.v_head_dim, meta["max_kv_splits"], device
            )
            meta["decode_buffers"] = buffers
        return buffers
