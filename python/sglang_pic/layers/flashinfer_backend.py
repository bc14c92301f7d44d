"""The FlashInfer attention backend: FlashInfer's FA2 paged kernels with their in-kernel RoPE over unrotated keys.

FlashInfer's `ROPE_LLAMA` mode rotates a key by its index in the row's page list, which is the position-free
layout of this engine once a batch is cut into rows (flashinfer_rows.py). APE's span attention scaling runs as
passes over the same rows with custom masks (every key outside the span groups, then each group with tempered
logits), merged by their log-sum-exps with each group weighted as APE weighs it. What it cannot express is refused when
the engine starts (`check_flashinfer_support`): RoPE other than plain or linearly scaled (llama3, YaRN), and
VeriCache's drafts, whose compressed KV keeps explicit key positions. FlashInfer computes sin/cos with fast
intrinsics rather than the model's table, so its outputs match the other backends to bf16 tolerance, not
bit for bit.

The kernels sit behind `RaggedAttention` (plan once per forward, run once per layer): `FlashInferKernels` calls
FlashInfer; tests plug in a torch double of its documented semantics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from sglang_pic.kernels.paged_layout import SpanScaling
from sglang_pic.kernels.torch_native import store_kv_torch
from sglang_pic.layers.attention_backend import AttentionBackend
from sglang_pic.layers.flashinfer_rows import RaggedRows, SpanGroups, decode_rows, extend_rows, span_groups
from sglang_pic.model_config import rope_scaling_type

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.model_config import ModelConfig

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-KV scratch; SGLang's default size for its FlashInfer backend


@dataclass(frozen=True)
class HeadShape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sm_scale: float

    @classmethod
    def of(cls, layer: "RadixAttention") -> HeadShape:
        return cls(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, layer.scaling)


@dataclass(frozen=True)
class RopeParams:
    """What ROPE_LLAMA takes: the base and a linear position scale (positions are divided by it)."""

    theta: float
    scale: float = 1.0


def check_flashinfer_support(model_config: "ModelConfig", speculative: bool) -> RopeParams:
    """The RoPE FlashInfer applies for this model, or a ValueError naming what it cannot do."""
    kind = rope_scaling_type(model_config.rope_scaling)
    if kind not in ("default", "linear"):
        raise ValueError(
            f"--attention-backend flashinfer: the model's {kind!r} rope_scaling is not expressible in FlashInfer's "
            "in-kernel RoPE (plain or linear only); use --attention-backend triton"
        )
    if speculative:
        raise ValueError(
            "--attention-backend flashinfer: VeriCache drafts read compressed KV at explicit key positions, which "
            "FlashInfer's RoPE cannot express; use --attention-backend triton with speculative decoding"
        )
    scale = float(model_config.rope_scaling["factor"]) if kind == "linear" else 1.0
    return RopeParams(model_config.rope_theta, scale)


def decode_on_tensor_cores(shape: HeadShape) -> bool:
    """FlashInfer's plain decode kernels take query groups up to 4 (a group of 7 is refused); larger groups decode
    with its prefill kernels on tensor cores."""
    return shape.num_qo_heads // shape.num_kv_heads > 4


class RaggedAttention(Protocol):
    def reserve_graphs(self, max_bs: int, max_request_keys: int) -> None:
        """Buffers for the decode graphs of up to `max_bs` requests of up to `max_request_keys` keys each."""

    def plan(self, rows: RaggedRows, graph_size: int | None = None) -> None:
        """Prepare this forward's rows (host work, once per forward); `graph_size`: for the CUDA graph of that many
        decode requests, whose buffers the plan then fills (before its capture and before each replay)."""

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] unrotated, buffers [slots, Hkv, D] unrotated: the planned rows' outputs [T, Hq, Dv]."""

    def plan_split(self, rows: RaggedRows, groups: SpanGroups) -> None:
        """Prepare APE's passes over `rows` (prefill kernels, a decode batch too): keys in groups.rest_mask, then
        keys in each of groups.span_masks."""

    def run_split(self, queries: list[torch.Tensor], k_buffer: torch.Tensor,
                  v_buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The planned passes, queries[0] over the rest and queries[1 + g] over span group g: each pass's output
        [T, Hq, Dv] and log-sum-exp [T, Hq] in base 2 (FlashInfer's)."""


def merge_span_groups(passes: list[tuple[torch.Tensor, torch.Tensor]], groups: SpanGroups) -> torch.Tensor:
    """Attention over all passes' keys (run_split's) with span group g weighed by exp(scale * temperature * LSE), its
    LSE that of the tempered logits (base 2 scales alike); a query's empty span group adds nothing."""
    (out_rest, lse_rest), spans = passes[0], passes[1:]
    has = groups.has_span[..., None]  # [G, T, 1]
    lses = torch.stack([lse_rest, *(lse for _, lse in spans)])  # [1 + G, T, Hq]
    lses[1:] = torch.where(has, lses[1:] * groups.weight[..., None], float("-inf"))
    weights = torch.exp2(lses - lses.max(0).values)[..., None]
    outs = torch.stack([out_rest.float(), *(out.float() for out, _ in spans)])
    outs[1:] = torch.where(has[..., None], outs[1:], 0.0)
    return ((weights * outs).sum(0) / weights.sum(0)).to(out_rest.dtype)


class FlashInferAttnBackend(AttentionBackend):
    captures_extends = False  # CUDA graphs for decode only: a prefill's plan is host work per batch anyway

    def __init__(self, kernels: RaggedAttention) -> None:
        self.kernels = kernels
        self.groups: SpanGroups | None = None  # this forward's APE split, when a request scales its spans

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        rows = self._rows(forward_batch)
        if forward_batch.span_scaling is None:
            self.groups = None
            self.kernels.plan(rows)
        else:
            self.groups = span_groups(rows, forward_batch.span_scaling)
            self.kernels.plan_split(rows, self.groups)

    def init_cuda_graph_state(self, max_bs: int, max_request_keys: int) -> None:
        self.kernels.reserve_graphs(max_bs, max_request_keys)

    def init_forward_metadata_capture(self, forward_batch: "ForwardBatch", size: int) -> None:
        self.kernels.plan(self._rows(forward_batch), graph_size=size)

    def init_forward_metadata_replay(self, forward_batch: "ForwardBatch", size: int, padding_row: int) -> None:
        fb, pad = forward_batch, size - forward_batch.batch_size
        table = fb.req_to_token_pool.req_to_token
        rows = decode_rows(table, fb.req_pool_indices_cpu + [padding_row] * pad, fb.seq_lens_cpu + [1] * pad)
        self.kernels.plan(rows, graph_size=size)

    @staticmethod
    def _rows(fb: "ForwardBatch") -> RaggedRows:
        table = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            return decode_rows(table, fb.req_pool_indices_cpu, fb.seq_lens_cpu)
        return extend_rows(table, fb.req_pool_indices_cpu, fb.positions_cpu, fb.attn_lo_cpu, fb.extend_seq_lens_cpu)

    def forward(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch") -> torch.Tensor:
        fb = forward_batch
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        store_kv_torch(k_buf, v_buf, fb.out_cache_loc, k.view(-1, layer.num_kv_heads, layer.head_dim),
                       v.view(-1, layer.num_kv_heads, layer.v_head_dim))
        q = q.view(-1, layer.num_heads, layer.head_dim)
        groups = self.groups
        if groups is None:
            out = self.kernels.run(q, k_buf, v_buf)
        else:
            tempered = [q / t[:, None, None].to(q.dtype) for t in groups.temperature]
            out = merge_span_groups(self.kernels.run_split([q, *tempered], k_buf, v_buf), groups)
        return out.reshape(q.shape[0], layer.num_heads * layer.v_head_dim)

    @torch.inference_mode()
    def warm_up(self, layer: "RadixAttention", token_to_kv_pool, req_to_token_pool, dtype: torch.dtype) -> int:
        """Plan and run the decode and the prefill kernel once on the padding row (every key the dummy slot 0), so
        FlashInfer JIT-compiles them (or loads them from its cache) at start, not inside a step; logs the time."""
        start = time.perf_counter()
        k_buf, v_buf = token_to_kv_pool.get_kv_buffer(layer.layer_id)
        table, pad = req_to_token_pool.req_to_token, req_to_token_pool.padding_row
        for rows in (decode_rows(table, [pad], [8]), extend_rows(table, [pad], [6, 7], [0, 0], [2])):
            self.kernels.plan(rows)
            self.kernels.run(k_buf.new_zeros((rows.num_queries, layer.num_heads, layer.head_dim), dtype=dtype), k_buf,
                             v_buf)
        # APE's masked passes, with keys 0-5 as the span group of both queries
        device = k_buf.device
        ones = torch.ones(1, dtype=torch.float32, device=device)
        scaling = SpanScaling(torch.tensor([[0, 6]], device=device), torch.tensor([0, 1], device=device),
                              torch.zeros(1, dtype=torch.int64, device=device), ones, ones, 1)
        self.kernels.plan_split(rows, span_groups(rows, scaling))
        q = k_buf.new_zeros((rows.num_queries, layer.num_heads, layer.head_dim))
        self.kernels.run_split([q, q], k_buf, v_buf)
        if k_buf.is_cuda:
            torch.cuda.synchronize(k_buf.device)
        logger.info("FlashInfer kernels ready in %.1f s (JIT-compiled at first use, then loaded from its cache)",
                    time.perf_counter() - start)
        return 4


class FlashInferKernels:
    """FlashInfer's wrappers with pages of one slot, on one workspace (one plan in use at a time): batch decode for
    decode batches (on tensor cores when the query group is over 4, where FlashInfer's plain decode kernels stop),
    one graph-mode decode wrapper per captured batch size, batch prefill (FA2) for the rest."""

    def __init__(self, shape: HeadShape, rope: RopeParams, dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("--attention-backend flashinfer runs on CUDA devices only")
        try:
            import flashinfer
        except ImportError as e:
            raise ValueError(f"--attention-backend flashinfer needs the flashinfer-python package ({e})") from e

        self._fi, self.shape, self.device = flashinfer, shape, device
        self.common = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=rope.theta, rope_scale=rope.scale,
                           sm_scale=shape.sm_scale, q_data_type=dtype, kv_data_type=dtype)
        self.tensor_cores = decode_on_tensor_cores(shape)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.decode = self._decoder()
        self.graph_indices = torch.empty(0, dtype=torch.int32, device=device)  # shared by the decode graphs
        self.graph_decoders: dict[int, object] = {}
        self._active = self.prefill
        self.split: list = []  # APE's masked prefill wrappers, one per pass, made as batches first need them
        # A plan's host-to-device copy reads its wrapper's pinned buffer when the stream reaches it; under overlap
        # scheduling the next plan can come sooner, so each wrapper's next plan waits for its last copy.
        self._copied: dict[int, torch.cuda.Event] = {}

    def _decoder(self, graph_size: int | None = None):
        graph = {}
        if graph_size is not None:  # the wrapper reads these buffers, which each plan fills
            graph = dict(use_cuda_graph=True, paged_kv_indices_buffer=self.graph_indices,
                         paged_kv_indptr_buffer=torch.empty(graph_size + 1, dtype=torch.int32, device=self.device),
                         paged_kv_last_page_len_buffer=torch.empty(graph_size, dtype=torch.int32, device=self.device))
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=self.tensor_cores,
                                                          **graph)

    def reserve_graphs(self, max_bs: int, max_request_keys: int) -> None:
        self.graph_indices = torch.empty(max_bs * max_request_keys, dtype=torch.int32, device=self.device)

    def _plan(self, wrapper, *args, **kwargs) -> None:
        if id(wrapper) in self._copied:
            self._copied[id(wrapper)].synchronize()
        s = self.shape
        wrapper.plan(*args, s.num_qo_heads, s.num_kv_heads, s.head_dim, 1, **kwargs, **self.common)
        self._copied[id(wrapper)] = torch.cuda.Event()
        self._copied[id(wrapper)].record()

    def plan(self, rows: RaggedRows, graph_size: int | None = None) -> None:
        s = self.shape
        if not rows.one_query_per_row:
            wrapper = self.prefill
            args = (rows.qo_indptr, rows.kv_indptr, rows.kv_indices, rows.kv_last_page_len)
            extra = dict(head_dim_vo=s.v_head_dim, causal=True)
        else:
            wrapper = self.decode
            if graph_size is not None:
                if graph_size not in self.graph_decoders:
                    self.graph_decoders[graph_size] = self._decoder(graph_size)
                wrapper = self.graph_decoders[graph_size]
            args, extra = (rows.kv_indptr, rows.kv_indices, rows.kv_last_page_len), {}
        self._plan(wrapper, *args, **extra)
        self._active = wrapper

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> torch.Tensor:
        return self._active.run(q, (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1)))

    def plan_split(self, rows: RaggedRows, groups: SpanGroups) -> None:
        masks = [groups.rest_mask, *groups.span_masks]
        while len(self.split) < len(masks):  # each with its own workspace: all plans are live in one forward
            self.split.append(self._fi.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device), "NHD", backend="fa2"))
        # the last page lengths on the host, beside the indptrs: the plan sizes the masks from all three there
        args = (rows.qo_indptr, rows.kv_indptr, rows.kv_indices, rows.kv_last_page_len.cpu())
        for wrapper, mask in zip(self.split, masks):
            self._plan(wrapper, *args, custom_mask=mask, head_dim_vo=self.shape.v_head_dim)

    def run_split(self, queries: list[torch.Tensor], k_buffer: torch.Tensor,
                  v_buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))
        return [tuple(wrapper.run(q, kv, return_lse=True)) for wrapper, q in zip(self.split, queries)]


def create_flashinfer_backend(layer: "RadixAttention", model_config: "ModelConfig",
                              speculative: bool) -> FlashInferAttnBackend:
    """The backend for a model whose attention layers look like `layer`; refuses what FlashInfer cannot do."""
    rope = check_flashinfer_support(model_config, speculative)
    device = layer.rotary.cos_sin_cache.device
    return FlashInferAttnBackend(FlashInferKernels(HeadShape.of(layer), rope, model_config.dtype, device))
