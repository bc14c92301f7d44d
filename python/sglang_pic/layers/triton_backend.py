"""GPU attention backend: fused store of unrotated k/v, then Triton extend or flash-decoding kernels with RoPE
applied inside attention from logical positions. Extends first stage their keys, rotated once, in a per-forward
workspace (kernels/stage_keys.py) when it fits its bound: the store writes the new keys there, a staging pass the
cached ones. Decodes rotate each key in-kernel.

Per-batch sizes come from the host-side lists of the ForwardBatch, so `forward` never synchronizes. In decode
the grid depends only on the batch size and the pool's kv-head count (see `num_kv_splits`), which keeps a captured
CUDA graph valid for any context lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.kernels.decode_attention import alloc_decode_buffers, decode_attention_fwd, num_kv_splits
from sglang_pic.kernels.extend_attention import extend_attention_fwd, extend_variants
from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV
from sglang_pic.kernels.shared_decode import alloc_shared_buffers, shared_decode_attention_fwd
from sglang_pic.kernels.stage_keys import (
    StagedKeys,
    alloc_staged_keys,
    has_cached_keys,
    should_stage_keys,
    stage_keys,
)
from sglang_pic.kernels.store_kv import store_kv
from sglang_pic.kv_cache_dtype import decode_tile_dtype
from sglang_pic.layers.attention_backend import AttentionBackend, scale_values

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention

CPU_NUM_SMS = 4  # only the Triton interpreter runs on CPU tensors; any small value works there

Buffers = tuple[torch.Tensor, torch.Tensor]


@dataclass
class TritonMetadata:
    """A batch's split between the kernels and its sizes. Its extends are the first `extends` requests and `rows`
    token rows, its decodes the rest. The workspaces are allocated by the forward's first layer (inside a CUDA graph
    capture when there is one) and shared by every layer."""

    extends: int
    rows: int
    ext: ExtendRows | None = None  # the extends' new tokens
    max_seq_len: int = 0  # the extends' longest context
    total_keys: int = 0  # the extends' contexts summed
    cached_keys: bool = False  # whether the extends read keys the store does not write (see has_cached_keys)
    max_kv_splits: int = 0  # key chunks of the per-request decode kernel
    staged: StagedKeys | None = None  # the extends' keys, rotated once (see stage_keys)
    decode_buffers: Buffers | None = None
    shared_buffers: Buffers | None = None  # the shared decode kernel's partials


def _paged(fb: "ForwardBatch", k_buf: torch.Tensor, v_buf: torch.Tensor, part: slice, longest: int = 0) -> PagedKV:
    """The keys of requests `part` of the batch in one layer's buffers."""
    table = fb.req_to_token_pool.req_to_token
    return PagedKV(k_buf, v_buf, table, fb.req_pool_indices[part], fb.seq_lens[part], longest)


class TritonAttnBackend(AttentionBackend):
    def __init__(self) -> None:
        self._num_sms: int | None = None

    def sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = CPU_NUM_SMS
        return self._num_sms

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        # Span scaling runs in the extend kernel only (a pass per span group, then attention): then every decode is
        # a one-token extend.
        decodes = fb.num_decodes if fb.span_scaling is None else 0
        extends = fb.batch_size - decodes
        meta = TritonMetadata(extends, fb.positions.shape[0] - decodes)
        if decodes and fb.shared_decode is None:
            meta.max_kv_splits = num_kv_splits(decodes, fb.token_to_kv_pool.head_num, self.sm_count(fb.seq_lens.device))
        if extends:
            seq_lens, new = fb.seq_lens_cpu[:extends], fb.extend_seq_lens_cpu[:extends]
            rows = meta.rows
            meta.ext = ExtendRows(
                fb.extend_start_loc[:extends], fb.extend_seq_lens[:extends], fb.positions[:rows], fb.attn_lo[:rows],
                max(new),
            )
            meta.max_seq_len, meta.total_keys = max(seq_lens), sum(seq_lens)
            meta.cached_keys = has_cached_keys(seq_lens, new)
        fb.attn_metadata = meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:
        fb = forward_batch
        meta: TritonMetadata = fb.attn_metadata
        pool, lid = fb.token_to_kv_pool, layer.layer_id
        k_buf, v_buf = pool.get_kv_buffer(lid)
        k, v = pool.to_storage(lid, k, v)
        sm_scale = layer.scaling * pool.k_scale[lid]
        cos_sin = layer.rotary.kernel_table(q.dtype)
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, layer.v_head_dim))
        extends, rows = meta.extends, meta.rows
        kv = _paged(fb, k_buf, v_buf, slice(None, extends), meta.max_seq_len) if extends else None
        staged = self._staging(meta, kv, layer.num_heads // layer.num_kv_heads, q.dtype) if extends else None
        store_kv(
            k_buf,
            v_buf,
            fb.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
            cos_sin,
            staged,
            fb.positions,
        )
        if extends:
            if staged is not None and meta.cached_keys:
                stage_keys(staged, kv, meta.ext, cos_sin)
            # A mixed batch's decodes go to the decode kernel below: in extend tiles each would fill one row.
            extend_attention_fwd(
                q3[:rows], out[:rows], kv, meta.ext, cos_sin, sm_scale, num_sms=self.sm_count(q.device),
                staged_keys=staged, span=fb.span_scaling,
            )
        if extends < fb.batch_size:
            decode_kv = _paged(fb, k_buf, v_buf, slice(extends, None))
            if fb.shared_decode is not None:
                if meta.shared_buffers is None:
                    meta.shared_buffers = alloc_shared_buffers(q3[rows:], fb.shared_decode, layer.v_head_dim)
                shared_decode_attention_fwd(
                    q3[rows:], out[rows:], decode_kv, fb.shared_decode, cos_sin, sm_scale, meta.shared_buffers
                )
            else:
                mid_o, mid_lse = self._decode_buffers(meta, fb.num_decodes, layer, q.device)
                table = layer.rotary.kernel_table(decode_tile_dtype(k_buf.dtype, q.dtype))
                decode_attention_fwd(q3[rows:], out[rows:], decode_kv, table, sm_scale, mid_o, mid_lse)
        return scale_values(out, pool.v_scale[lid]).view(q3.shape[0], layer.num_heads * layer.v_head_dim)

    @torch.inference_mode()
    def warm_up(self, layer: "RadixAttention", token_to_kv_pool, req_to_token_pool, dtype: torch.dtype) -> int:
        """Compile, at startup, every kernel variant `forward` can launch for the pool's layers. Triton compiles a
        variant on its first launch, which on a machine with an empty Triton cache takes seconds inside the step
        that needs it while every running request waits. Per-batch integers are not specialized (see the kernels),
        so the variants are: each extend tile (by query rows and context) with keys staged or rotated in-kernel and
        the key range split or not, staging, the store and decode. Each runs one request on the padding row of the
        request table: every key is the dummy slot 0, the only slot written. Returns the number of attention
        launches. APE's span passes (SPAN_PASS 1 and 2) are left to compile at a request's first use: they would
        triple the extend variants for a setting few servers use."""
        k_buf, v_buf = token_to_kv_pool.get_kv_buffer(layer.layer_id)
        device = k_buf.device
        cos_sin = layer.rotary.kernel_table(dtype)
        group = layer.num_heads // layer.num_kv_heads
        table = req_to_token_pool.req_to_token
        request = torch.full((1,), req_to_token_pool.padding_row, dtype=torch.int64, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        longest = min(cos_sin.shape[0], table.shape[1])  # no request outgrows the context
        variants = [v for v in extend_variants(group, layer.head_dim, dtype, device) if v[1] <= longest]
        for tokens, keys, stage, splits in variants:
            q = torch.zeros((tokens, layer.num_heads, layer.head_dim), dtype=dtype, device=device)
            out = torch.empty((tokens, layer.num_heads, layer.v_head_dim), dtype=dtype, device=device)
            k = torch.zeros((tokens, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=device)
            v = torch.zeros((tokens, layer.num_kv_heads, layer.v_head_dim), dtype=dtype, device=device)
            zeros = torch.zeros(tokens, dtype=torch.int64, device=device)  # slots written; lowest visible keys
            lens = torch.full((1,), tokens, dtype=torch.int64, device=device)
            positions = torch.arange(keys - tokens, keys, device=device)
            kv = PagedKV(k_buf, v_buf, table, request, torch.full_like(lens, keys), keys)
            ext = ExtendRows(zero, lens, positions, zeros, tokens)
            staged = alloc_staged_keys(kv, ext, keys, dtype) if stage else None
            store_kv(k_buf, v_buf, zeros, k, v, cos_sin, staged, positions)
            if staged is not None:
                stage_keys(staged, kv, ext, cos_sin)
            extend_attention_fwd(
                q, out, kv, ext, cos_sin, layer.scaling, num_splits=splits, num_sms=self.sm_count(device),
                staged_keys=staged,
            )
        mid_o, mid_lse = alloc_decode_buffers(1, layer.num_heads, layer.v_head_dim, 1, device)
        table = layer.rotary.kernel_table(decode_tile_dtype(k_buf.dtype, dtype))
        decode_attention_fwd(q[:1], out[:1], kv, table, layer.scaling, mid_o, mid_lse)
        return len(variants) + 1

    @staticmethod
    def _staging(meta: TritonMetadata, kv: PagedKV, group: int, dtype: torch.dtype) -> StagedKeys | None:
        """The workspace the extends' keys are staged in, rotated once (see stage_keys), shared by every layer of
        the forward; None when the kernel rotates them itself (few query rows per request, or a workspace past its
        bound). `group`: query heads per kv head; `dtype`: the queries'."""
        if not should_stage_keys(meta.total_keys, kv.k_buffer, meta.ext.max_extend_len * group, dtype):
            return None
        if meta.staged is None:
            meta.staged = alloc_staged_keys(kv, meta.ext, meta.total_keys, dtype)
        return meta.staged

    @staticmethod
    def _decode_buffers(
        meta: TritonMetadata, decodes: int, layer: "RadixAttention", device: torch.device
    ) -> Buffers:
        buffers = meta.decode_buffers
        if buffers is None or buffers[0].shape[1:] != (layer.num_heads, meta.max_kv_splits, layer.v_head_dim):
            buffers = alloc_decode_buffers(decodes, layer.num_heads, layer.v_head_dim, meta.max_kv_splits, device)
            meta.decode_buffers = buffers
        return buffers
