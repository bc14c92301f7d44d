"""KIVI: a 2-bit draft cache. Keys are quantized per channel, values per token, recent tokens stay exact.

Keys vary most across channels (a few outlier channels), so each key channel gets its own scale and zero over a
group of GROUP tokens; values are quantized per token over groups of channels. The pool stores keys unrotated,
which suits per-channel quantization: RoPE would spread a channel's outliers over its rotation pair.

Every token is kept, so draft positions are the original ones: the quantized prefix covers positions
[0, pos_offset) and the draft rows (device slots, full precision) the rest. Once the rows hold `budget` + GROUP
tokens, whole groups move from the rows into the prefix, so between budget and budget + GROUP - 1 tokens stay
exact.

Draft attention with the Triton backend reads the packed codes and scales inside a flash-decoding loop over the
prefix followed by the exact rows (kernels/kivi_decode.py); each request's tensors are reached through their
addresses, so quantizing never copies into a shared pool. With torch_native, `KiviDraftBackend` dequantizes the
prefix in torch, one request at a time: the reference the kernel is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang_pic.kernels.decode_attention import alloc_decode_buffers, num_kv_splits
from sglang_pic.kernels.kivi_decode import QUANT_FIELDS, KiviKV, kivi_decode_fwd
from sglang_pic.kernels.torch_native import rope_rotate
from sglang_pic.layers.attention_backend import AttentionBackend
from sglang_pic.layers.triton_backend import TritonAttnBackend
from sglang_pic.speculative.compressor_base import Compressor, KVSource, register
from sglang_pic.speculative.draft_cache import DraftBackend, DraftBatch, DraftCache
from sglang_pic.utils_tensor import upload

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention

BITS = 2
LEVELS = (1 << BITS) - 1
CODES_PER_BYTE = 8 // BITS
GROUP = 32
BUILD_CHUNK = 2048  # tokens quantized together when a draft is built (a multiple of GROUP)


@dataclass
class Quantized:
    """Packed codes with the scale and zero point of each group: x ~= code * scale + zero."""

    codes: torch.Tensor  # uint8, CODES_PER_BYTE codes per byte along the last dim
    scale: torch.Tensor  # float32
    zero: torch.Tensor  # float32


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest over the last dim: (codes, scale, zero); |x - dequant| <= scale / 2."""
    x = x.float()
    zero = x.amin(dim=-1, keepdim=True)
    scale = (x.amax(dim=-1, keepdim=True) - zero) / LEVELS
    codes = torch.round((x - zero) / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(0, LEVELS)
    return codes.to(torch.uint8), scale, zero


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] -> [..., D / CODES_PER_BYTE], the first code in the lowest bits."""
    parts = codes.view(*codes.shape[:-1], -1, CODES_PER_BYTE)
    shifts = torch.arange(0, 8, BITS, dtype=torch.uint8, device=codes.device)
    return (parts << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 8, BITS, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & LEVELS
    return codes.view(*packed.shape[:-1], -1)


def quantize_keys(k: torch.Tensor) -> Quantized:
    """k [T, H, D] with T a multiple of GROUP: per channel over each group of GROUP tokens; scale [T/G, H, D]."""
    t, h, d = k.shape
    groups = k.view(t // GROUP, GROUP, h, d).permute(0, 2, 3, 1)  # [T/G, H, D, G]
    codes, scale, zero = quantize_groups(groups)
    codes = codes.permute(0, 3, 1, 2).reshape(t, h, d)
    return Quantized(pack(codes), scale.squeeze(-1).contiguous(), zero.squeeze(-1).contiguous())


def dequantize_keys(q: Quantized) -> torch.Tensor:
    codes = unpack(q.codes).float()
    t, h, d = codes.shape
    groups = codes.view(t // GROUP, GROUP, h, d)
    return (groups * q.scale[:, None] + q.zero[:, None]).view(t, h, d)


def value_group(head_dim: int) -> int:
    return math.gcd(GROUP, head_dim)


def quantize_values(v: torch.Tensor) -> Quantized:
    """v [T, H, D]: per token over groups of value_group(D) channels; scale [T, H, D / group]."""
    t, h, d = v.shape
    codes, scale, zero = quantize_groups(v.view(t, h, d // value_group(d), value_group(d)))
    return Quantized(pack(codes.view(t, h, d)), scale.squeeze(-1).contiguous(), zero.squeeze(-1).contiguous())


def dequantize_values(q: Quantized) -> torch.Tensor:
    codes = unpack(q.codes).float()
    t, h, d = codes.shape
    g = value_group(d)
    return (codes.view(t, h, d // g, g) * q.scale[..., None] + q.zero[..., None]).view(t, h, d)


def prefix_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int) -> int:
    """Device bytes one quantized token takes over all layers: its codes and its share of the float32 scales and
    zeros (a quarter of a bf16 KV token for 64- and 128-dim heads)."""
    codes = kv_heads * (head_dim + v_head_dim) // CODES_PER_BYTE
    key_scales = 2 * 4 * kv_heads * head_dim // GROUP
    value_scales = 2 * 4 * kv_heads * (v_head_dim // value_group(v_head_dim))
    return num_layers * (codes + key_scales + value_scales)


def quantize_layers(k: torch.Tensor, v: torch.Tensor) -> tuple[Quantized, Quantized]:
    """k [L, T, H, D], v [L, T, H, Dv] of every layer at once (T a multiple of GROUP): parts shaped [L, ...]."""
    layers, t = k.shape[:2]
    keys = quantize_keys(k.reshape(layers * t, *k.shape[2:]))
    values = quantize_values(v.reshape(layers * t, *v.shape[2:]))
    return tuple(Quantized(*(x.view(layers, -1, *x.shape[1:]) for x in (q.codes, q.scale, q.zero)))
                 for q in (keys, values))


def _cat(parts: list[Quantized]) -> Quantized:
    return Quantized(*(torch.cat(x, dim=1) for x in zip(*((q.codes, q.scale, q.zero) for q in parts))))


class KiviPrefix:
    """The quantized tokens [0, length) of one request: each part holds every layer ([layers, ...]), so appending
    quantizes all layers at once. `addresses` [layers, 6] lists each layer's six parts (key codes, scale, zero,
    value codes, scale, zero) for the fused kernel, zeros while empty."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.length = 0
        self.addresses = torch.zeros((num_layers, QUANT_FIELDS), dtype=torch.int64, device=device)

    @property
    def num_layers(self) -> int:
        return self.addresses.shape[0]

    def extend(self, chunks: list[tuple[Quantized, Quantized]]) -> None:
        """Append quantize_layers' outputs for the next tokens, in order."""
        if not chunks:
            return
        merged = ([] if self.keys is None else [(self.keys, self.values)]) + chunks
        self.keys = _cat([keys for keys, _ in merged])
        self.values = _cat([values for _, values in merged])
        self.length = self.keys.codes.shape[1]
        parts = [x for q in (self.keys, self.values) for x in (q.codes, q.scale, q.zero)]
        assert all(x.is_contiguous() for x in parts)
        flat = [x.data_ptr() + i * x.stride(0) * x.element_size() for i in range(self.num_layers) for x in parts]
        self.addresses.copy_(torch.tensor(flat, dtype=torch.int64).view(self.addresses.shape))

    def dequantize(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.keys is None:
            return None
        k, v = (Quantized(q.codes[layer], q.scale[layer], q.zero[layer]) for q in (self.keys, self.values))
        return dequantize_keys(k), dequantize_values(v)


@register
class KiviCompressor(Compressor):
    name = "kivi"

    def bytes_per_token_outside_pool(self, num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int) -> int:
        return prefix_bytes_per_token(num_layers, kv_heads, head_dim, v_head_dim)

    def max_draft_tokens(self, num_tokens: int, budget: int) -> int:
        return min(num_tokens, budget + GROUP - 1)

    def build(
        self, src: KVSource, budget: int, scores: torch.Tensor | None, state: Any, device: torch.device
    ) -> DraftCache:
        """Quantize all but the last budget..budget+GROUP-1 tokens, BUILD_CHUNK tokens of every layer at a time."""
        n = src.num_tokens
        quantized = max(n - budget, 0) // GROUP * GROUP
        prefix = KiviPrefix(src.num_layers, device)
        chunks = []
        for start in range(0, quantized, BUILD_CHUNK):
            index = torch.arange(start, min(start + BUILD_CHUNK, quantized), device=device)
            k, v = zip(*(src.read(layer, index) for layer in range(src.num_layers)))
            chunks.append(quantize_layers(torch.stack(k), torch.stack(v)))
        prefix.extend(chunks)
        rows = src.rows_for(torch.arange(quantized, n, device=device)[None])
        return DraftCache.from_rows(rows, covered=n, pos_offset=quantized, prefix=prefix)

    def needs_refresh(self, draft: DraftCache, budget: int) -> bool:
        return draft.length >= budget + GROUP

    def refresh(
        self, draft: DraftCache, src: KVSource, budget: int, scores: torch.Tensor | None, device: torch.device
    ) -> DraftCache:
        """Move whole groups of the oldest exact rows into the prefix, read from the rows' own device slots."""
        m = (draft.length - budget) // GROUP * GROUP
        slots = draft.rows[0, :m]
        k, v = zip(*(src.pool.get_kv_buffer(layer) for layer in range(src.num_layers)))
        draft.prefix.extend([quantize_layers(torch.stack([x[slots] for x in k]), torch.stack([x[slots] for x in v]))])
        draft.drop_front(m)
        draft.built_at = draft.covered
        return draft

    def draft_backend(self, inner: AttentionBackend, batch: DraftBatch, pool) -> DraftBackend:
        if not isinstance(inner, TritonAttnBackend):
            return KiviDraftBackend(pool, batch)
        backend = KiviTritonDraftBackend(pool, inner, batch.tables[0], batch.drafts[0].prefix.num_layers)
        backend.load(batch)
        return backend

    def drafts_on_static_tables(self, inner: AttentionBackend) -> bool:
        return isinstance(inner, TritonAttnBackend)

    def static_draft_backend(self, inner: AttentionBackend, tables: torch.Tensor, pool) -> DraftBackend:
        return KiviTritonDraftBackend(pool, inner, tables[0], tables.shape[0])


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query q [Hq, D] over all of k [n, Hkv, D], v [n, Hkv, Dv] (rotated, float32) -> [Hq, Dv]."""
    hkv = k.shape[1]
    qh = q.view(hkv, q.shape[0] // hkv, q.shape[1])
    probs = torch.softmax(torch.einsum("hgd,nhd->hgn", qh, k) * scale, dim=-1)
    return torch.einsum("hgn,nhd->hgd", probs, v).reshape(q.shape[0], v.shape[-1])


class _KiviBackend(DraftBackend):
    """Stores each draft token's k/v in its scratch slot, then attends over quantized prefix plus exact rows.

    A step's `seq_lens` count the rows a query sees (its draft index + 1), `positions` are true positions and
    `req_pool_indices` (on the host `req_pool_indices_cpu`) each query's row of the draft tables.
    """

    def __init__(self, pool) -> None:
        self.pool = pool

    def forward(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        fb = forward_batch
        self.pool.set_kv_buffer(
            layer.layer_id, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.v_head_dim),
        )
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty((q3.shape[0], layer.num_heads, layer.v_head_dim), dtype=q.dtype, device=q.device)
        self._attend(q3, out, layer, fb)
        return out.view(q3.shape[0], layer.num_heads * layer.v_head_dim)

    def _attend(self, q3: torch.Tensor, out: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> None:
        raise NotImplementedError


class KiviDraftBackend(_KiviBackend):
    """Dequantizes each request's prefix in torch and attends one query at a time: the reference path."""

    def __init__(self, pool, batch: DraftBatch) -> None:
        super().__init__(pool)
        self.batch = batch

    def _attend(self, q3: torch.Tensor, out: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> None:
        lid = layer.layer_id
        k_buf, v_buf = self.pool.get_kv_buffer(lid)
        cos_sin = layer.rotary.cos_sin_cache
        table = self.batch.tables[0]
        for t, b in enumerate(fb.req_pool_indices_cpu):
            slots = table[b, : fb.seq_lens_cpu[t]]
            keys, values = k_buf[slots].float(), v_buf[slots].float()
            prefix = self.batch.drafts[b].prefix.dequantize(lid)
            if prefix is not None:
                keys, values = torch.cat([prefix[0], keys]), torch.cat([prefix[1], values])
            keys = rope_rotate(keys, torch.arange(keys.shape[0], device=q3.device), cos_sin)
            query = rope_rotate(q3[t : t + 1], fb.positions[t : t + 1], cos_sin)[0]
            out[t] = gqa_attention(query, keys, values, layer.scaling).to(q3.dtype)


@dataclass(frozen=True)
class KiviStep:
    """The draft step's queries' entries of the backend's buffers, gathered by the first layer."""

    table: torch.Tensor  # [B, W] each query's row of the draft table
    totals: torch.Tensor  # [B] keys each query sees, prefix included
    prefix_lens: torch.Tensor  # [B]
    addresses: torch.Tensor  # [layers, B, QUANT_FIELDS]
    buffers: tuple[torch.Tensor, torch.Tensor]  # the split partials (alloc_decode_buffers)


@dataclass
class KiviMetadata:
    splits: int  # key chunks per query
    step: KiviStep | None = None  # gathered by the first layer (inside a CUDA graph capture when there is one)


class KiviTritonDraftBackend(_KiviBackend):
    """The fused kernel over a draft table [rows, W] (a round's own, or static ones a CUDA graph reads) and buffers
    of each row's prefix length and prefix addresses, filled by `load`. The first layer of a step gathers its
    queries' entries (inside a graph capture when there is one); every layer reads them."""

    def __init__(self, pool, inner: TritonAttnBackend, table: torch.Tensor, num_layers: int) -> None:
        super().__init__(pool)
        self.inner = inner
        self.table = table
        rows, device = table.shape[0], table.device
        self.prefix_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.addresses = torch.zeros((num_layers, rows, QUANT_FIELDS), dtype=torch.int64, device=device)

    def load(self, batch: DraftBatch) -> None:
        n = len(batch.drafts)
        self.prefix_lens[:n].copy_(upload([d.prefix.length for d in batch.drafts], device=self.prefix_lens.device))
        self.addresses[:, :n].copy_(torch.stack([d.prefix.addresses for d in batch.drafts], dim=1))

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        heads = forward_batch.token_to_kv_pool.head_num
        device = forward_batch.seq_lens.device
        forward_batch.attn_metadata = KiviMetadata(num_kv_splits(forward_batch.batch_size, heads,
                                                                 self.inner.sm_count(device)))

    def _attend(self, q3: torch.Tensor, out: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> None:
        meta: KiviMetadata = fb.attn_metadata
        if meta.step is None:
            rows = fb.req_pool_indices
            prefix_lens = self.prefix_lens[rows]
            buffers = alloc_decode_buffers(q3.shape[0], layer.num_heads, layer.v_head_dim, meta.splits, q3.device)
            meta.step = KiviStep(self.table[rows], prefix_lens + fb.seq_lens, prefix_lens, self.addresses[:, rows],
                                 buffers)
        step = meta.step
        k_buf, v_buf = self.pool.get_kv_buffer(layer.layer_id)
        kv = KiviKV(k_buf, v_buf, step.table, step.totals, step.prefix_lens, step.addresses[layer.layer_id], GROUP,
                    value_group(layer.v_head_dim))
        kivi_decode_fwd(q3, out, kv, layer.rotary.kernel_table(q3.dtype), layer.scaling, *step.buffers)
