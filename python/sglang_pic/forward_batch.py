"""What one model forward needs to know about its batch: token rows, logical positions and KV addressing.

A request contributes `extend_seq_len` new tokens, in increasing position order. They need not be contiguous in the
request: cached spans may sit between them. Every new token carries its logical position (its index in the request)
and `attn_lo`, the lowest key index it may see (0 for prefix, PDEP and decode tokens, the span's start for span
tokens). A query at position p sees keys j with attn_lo <= j <= p, read through req_to_token[req_pool_index, j] and
rotated by j.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_pic.kernels.shared_decode_plan import SharedDecodePlan
    from sglang_pic.layers.attention_backend import AttentionBackend
    from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # any number of new tokens per request (prefill chunks, span prefills, mixed batches)
    DECODE = auto()  # exactly one new token per request at position seq_len - 1, attending to all keys

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, logical position of each new token
    attn_lo: torch.Tensor  # [T] int64, lowest visible key index per new token
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written for each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, keys 0..seq_len-1 are addressable (= max query position + 1)
    extend_seq_lens: torch.Tensor  # [B] int64, new tokens per request
    extend_start_loc: torch.Tensor  # [B] int64, offset of each request's first new token in the T rows
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    attn_backend: "AttentionBackend"
    # Rows of the T new tokens whose logits are computed (last token per request, or more for input logprobs).
    logits_indices: torch.Tensor | None = None
    # EXTEND only: the last num_decode_tail requests are running decodes riding along (one token each at position
    # seq_len - 1, seeing every key), which a backend may hand to its decode kernel.
    num_decode_tail: int = 0
    # The decodes' keys cut into runs shared across requests (kernels/shared_decode.py); None: each request reads
    # its own keys. Set only for the Triton backend, and such a batch runs eagerly.
    shared_decode: "SharedDecodePlan | None" = None
    attn_metadata: dict = field(default_factory=dict)  # backend-private, filled by init_forward_metadata

    @property
    def num_decodes(self) -> int:
        """Requests decoding one token: every request of a DECODE batch, the riding tail of an EXTEND batch."""
        return self.batch_size if self.forward_mode.is_decode() else self.num_decode_tail
