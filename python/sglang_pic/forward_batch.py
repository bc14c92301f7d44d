"""What one model forward needs to know about its batch: token rows, logical positions and KV addressing.

A request contributes `extend_seq_len` new tokens, in increasing position order. They need not be contiguous in the
request: cached spans may sit between them. Every new token carries its logical position (its index in the request)
and `attn_lo`, the lowest key index it may see (0 for prefix, PDEP and decode tokens, the span's start for span
tokens). A query at position p sees keys j with attn_lo <= j <= p, read through req_to_token[req_pool_index, j] and
rotated by j. `span_adapter_rows` marks the tokens of requests that run under a span adapter kept apart from the
weights (layers/row_lora.py): those whose prompt keeps a span, and span jobs.

Every producer (scheduler, speculation, CUDA graphs, benchmarks) fills `BatchRows` with host lists and calls
`ForwardBatch.build`, which uploads them in one copy and derives the rest; tensor parallelism ships a batch with
`pack` / `unpack`. Both follow the field lists below, so a field added to them travels everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum, auto
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from sglang_pic.utils_tensor import upload

if TYPE_CHECKING:
    from sglang_pic.kernels.paged_layout import SpanScaling
    from sglang_pic.kernels.shared_decode_plan import SharedDecodePlan
    from sglang_pic.layers.attention_probe import AttentionProbe
    from sglang_pic.layers.deviation_probe import DeviationProbe
    from sglang_pic.layers.attention_backend import AttentionBackend
    from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

# int64 [T] device tensors
TOKEN_FIELDS = ("input_ids", "positions", "attn_lo", "span_adapter_rows", "out_cache_loc")
REQUEST_FIELDS = ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_start_loc")  # int64 [B] device tensors
HOST_FIELDS = ("req_pool_indices_cpu", "seq_lens_cpu", "extend_seq_lens_cpu")  # host copies of request fields
# Host copies of token fields: a backend that plans on the host (FlashInfer) reads them instead of syncing with the
# device, which under overlap scheduling would wait for the step in flight; an eager forward with no adapter rows
# skips the adapter.
HOST_TOKEN_FIELDS = ("positions_cpu", "attn_lo_cpu", "span_adapter_rows_cpu")


class ForwardMode(IntEnum):
    EXTEND = auto()  # any number of new tokens per request (prefill chunks, span prefills, mixed batches)
    DECODE = auto()  # exactly one new token per request at position seq_len - 1, attending to all keys

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND


@dataclass
class BatchRows:
    """A batch's integers as host lists, filled request by request; `ForwardBatch.build` uploads them at once."""

    input_ids: list[int] = field(default_factory=list)  # per new token (left empty when they come as a tensor)
    positions: list[int] = field(default_factory=list)
    attn_lo: list[int] = field(default_factory=list)
    span_adapter_rows: list[int] = field(default_factory=list)  # 1: the token's request runs under the span adapter
    req_pool_indices: list[int] = field(default_factory=list)  # per request
    seq_lens: list[int] = field(default_factory=list)
    extend_seq_lens: list[int] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)  # token rows whose logits are computed

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def add(
        self, row: int, positions: list[int] | range, attn_lo: list[int], seq_len: int | None = None,
        span_adapter: bool = False,
    ) -> None:
        """A request of table row `row` whose new tokens sit at `positions`, each seeing keys from its attn_lo
        on; its keys 0..seq_len-1 are addressable (by default through its last new token). `span_adapter`: its
        tokens run under the span adapter (when one is served apart from the weights)."""
        self.positions += positions
        self.attn_lo += attn_lo
        self.span_adapter_rows += [int(span_adapter)] * len(positions)
        self.req_pool_indices.append(row)
        self.seq_lens.append(positions[-1] + 1 if seq_len is None else seq_len)
        self.extend_seq_lens.append(len(positions))


@dataclass(frozen=True)
class BatchHeader:
    """A batch's shape, as tensor parallelism sends it ahead of the batch so followers can size their buffers."""

    mode: ForwardMode
    num_tokens: int
    batch_size: int
    num_logits: int
    num_decode_tail: int

    @classmethod
    def size(cls) -> int:
        """Integers in `to_list`."""
        return len(fields(cls))

    def to_list(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[int]) -> BatchHeader:
        mode, *sizes = values
        return cls(ForwardMode(mode), *sizes)

    def device_sizes(self) -> list[int]:
        """Lengths of the device columns `ForwardBatch.pack` concatenates: token fields, request fields, logits."""
        return [self.num_tokens] * len(TOKEN_FIELDS) + [self.batch_size] * len(REQUEST_FIELDS) + [self.num_logits]

    def host_size(self) -> int:
        return self.batch_size * len(HOST_FIELDS) + self.num_tokens * len(HOST_TOKEN_FIELDS)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, logical position of each new token
    attn_lo: torch.Tensor  # [T] int64, lowest visible key index per new token
    span_adapter_rows: torch.Tensor  # [T] int64, 1 where the token's request runs under the span adapter
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written for each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, keys 0..seq_len-1 are addressable (= max query position + 1)
    extend_seq_lens: torch.Tensor  # [B] int64, new tokens per request
    extend_start_loc: torch.Tensor  # [B] int64, offset of each request's first new token in the T rows
    req_pool_indices_cpu: list[int]
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    positions_cpu: list[int]
    attn_lo_cpu: list[int]
    span_adapter_rows_cpu: list[int]
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
    # The backend's own dataclass of per-batch data, set by its init_forward_metadata.
    attn_metadata: Any = None
    # Question rows whose attention every layer also scores (layers/attention_probe.py); None: none. Tensor
    # parallelism sends it beside the packed batch (model_executor/batch_broadcast.py).
    probe: "AttentionProbe | None" = None
    # APE's scaling of attention to span keys for the batch's requests that ask for it (kernels/paged_layout.py);
    # None: none do. Its decodes then run in the extend kernel, and the batch eagerly.
    span_scaling: "SpanScaling | None" = None
    # A deviation pass's comparison of new and shared span KV (layers/deviation_probe.py); the model then runs only
    # layers up to the probe's and computes no logits. None: a whole forward.
    deviation: "DeviationProbe | None" = None

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        rows: BatchRows,
        out_cache_loc: torch.Tensor,
        device: torch.device,
        *,
        req_to_token_pool,
        token_to_kv_pool,
        attn_backend,
        input_ids: torch.Tensor | None = None,
        num_decode_tail: int = 0,
        shared_decode: "SharedDecodePlan | None" = None,
    ) -> ForwardBatch:
        """The batch of `rows`, every integer uploaded to `device` in one copy (a copy per list from pageable
        memory would wait for every kernel already queued). `input_ids` [T]: ids already on the device, used
        instead of rows.input_ids. Each request's extend_start_loc follows from the new-token counts."""
        columns = {f.name: getattr(rows, f.name) for f in fields(rows)}
        columns["extend_start_loc"] = [0, *accumulate(rows.extend_seq_lens)][:-1]
        if input_ids is not None:
            columns["input_ids"] = []
        parts = upload(*columns.values(), device=device).split([len(c) for c in columns.values()])
        tensors = dict(zip(columns, parts))
        if input_ids is not None:
            tensors["input_ids"] = input_ids
        return cls(
            forward_mode=mode,
            out_cache_loc=out_cache_loc.to(device),
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            num_decode_tail=num_decode_tail,
            shared_decode=shared_decode,
            **tensors,
            **{name: getattr(rows, name.removesuffix("_cpu")) for name in HOST_FIELDS + HOST_TOKEN_FIELDS},
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decodes(self) -> int:
        """Requests decoding one token: every request of a DECODE batch, the riding tail of an EXTEND batch."""
        return self.batch_size if self.forward_mode.is_decode() else self.num_decode_tail

    def header(self) -> BatchHeader:
        logits = 0 if self.logits_indices is None else self.logits_indices.numel()
        return BatchHeader(self.forward_mode, self.input_ids.numel(), self.batch_size, logits, self.num_decode_tail)

    def pack(self) -> tuple[torch.Tensor, list[int]]:
        """(the device fields in one int64 tensor, the host lists in one list), laid out as `header()` says."""
        logits = self.logits_indices if self.logits_indices is not None else self.input_ids.new_empty(0)
        tensors = torch.cat([*(getattr(self, f) for f in TOKEN_FIELDS + REQUEST_FIELDS), logits])
        return tensors, [x for f in HOST_FIELDS + HOST_TOKEN_FIELDS for x in getattr(self, f)]

    @classmethod
    def unpack(
        cls, header: BatchHeader, packed: torch.Tensor, host: list[int], *, req_to_token_pool, token_to_kv_pool,
        attn_backend, shared_decode: "SharedDecodePlan | None" = None,
    ) -> ForwardBatch:
        """The batch `pack` laid out, over this process's pools and backend."""
        *tensors, logits = packed.split(header.device_sizes())
        b = header.batch_size
        sizes = [b] * len(HOST_FIELDS) + [header.num_tokens] * len(HOST_TOKEN_FIELDS)
        ends = list(accumulate(sizes))
        lists = [host[end - n : end] for n, end in zip(sizes, ends)]
        return cls(
            forward_mode=header.mode,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            logits_indices=logits,
            num_decode_tail=header.num_decode_tail,
            shared_decode=shared_decode,
            **dict(zip(TOKEN_FIELDS + REQUEST_FIELDS, tensors)),
            **dict(zip(HOST_FIELDS + HOST_TOKEN_FIELDS, lists)),
        )
