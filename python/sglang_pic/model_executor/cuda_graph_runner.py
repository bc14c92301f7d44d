"""CUDA graphs for decode steps and for small one-request extends, replayed with the batch copied into static inputs.

Decode: one graph per padded batch size. Padded rows point at the request table's padding row (every slot 0, the
dummy KV slot) with seq_len 1, so they attend to one harmless key and write their KV into slot 0. The attention
backend's decode grid depends only on the batch size, so one capture serves every context length. With shared
decode (kernels/shared_decode.py) each batch size has a second graph, whose attention reads a static plan sized
by the batch size; a step whose plan fits replays it, any other the per-request graph.

Extend: one graph per padded token count for a single request, the step of a prompt whose spans and prefix are
cached. Eager, that step launches ~1,700 kernels for a few dozen new tokens and its launch time exceeds its GPU time.
The request's extend_seq_len holds the true count, so the kernel masks the padded rows out of attention; they write
their KV into slot 0. The grid is sized for the padded count and the model's context length (the most key chunks,
and a key-staging workspace of that many keys when it fits its bound), and each chunk's key range is derived on
the device from the true positions, so one capture serves every context.

With a span adapter served apart (layers/row_lora.py) every graph is captured twice, with the adapter's per-row
switch inside and without it: a batch with no row under the adapter replays the plain graph and pays nothing for it.

The engine holds one runner over its request table and backend; VeriCache holds another over its draft tables
(speculative/draft_runner.py). Both share one memory pool: their graphs never run at the same time.
"""

from __future__ import annotations

import bisect
import gc
import logging
from dataclasses import dataclass

import torch

from sglang_pic.forward_batch import REQUEST_FIELDS, TOKEN_FIELDS, ForwardBatch, ForwardMode
from sglang_pic.kernels.shared_decode_plan import StaticSharedPlan, members_per_item

logger = logging.getLogger(__name__)

GraphKey = tuple[ForwardMode, int, bool, bool]  # mode, padded size, shared decode, span adapter rows


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Decode batch sizes to capture, up to `max_bs` and always including it: steps of 16 to 256, of 32 beyond (a
    replay pads the batch to the next size)."""
    sizes = [1, 2, 4, 8, 12, 16, 24, *range(32, 256, 16), *range(256, max_bs, 32)]
    return [bs for bs in sizes if bs < max_bs] + [max(max_bs, 1)]


def capture_extend_sizes(max_tokens: int) -> list[int]:
    """Padded token counts of one-request extend graphs (none when max_tokens < 16)."""
    return [n for n in (16, 32, 64, 128, 256, 512) if n <= max_tokens]


def engine_capture_sizes(runner) -> tuple[list[int], list[int]]:
    """The engine's decode batch sizes (up to --cuda-graph-max-bs, at most --max-running-requests) and one-request
    extend sizes (up to --cuda-graph-max-extend-tokens, none for a backend that captures no extends)."""
    args = runner.server_args
    extends = capture_extend_sizes(args.cuda_graph_max_extend_tokens) if runner.attn_backend.captures_extends else []
    return capture_batch_sizes(min(args.cuda_graph_max_bs, args.max_running_requests)), extends


def adapter_variants(model) -> tuple[bool, ...]:
    """Whether graphs are captured without and with a span adapter's rows switched on: both where the model serves
    one apart from its weights (layers/row_lora.py), else only without."""
    return (False, True) if getattr(model, "adapter_rows", None) is not None else (False,)


@dataclass
class StaticInputs:
    """Device tensors a captured graph reads, one per device field of ForwardBatch (TOKEN_FIELDS of `tokens` rows,
    REQUEST_FIELDS of `reqs`); a replay copies the live batch into their leading rows."""

    tensors: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, tokens: int, reqs: int, padding_row: int, device: torch.device) -> StaticInputs:
        """Token rows start as token 0 at position 0 writing slot 0; requests as one-token decodes of the padding
        row with seq_len 1, their token rows one after another."""
        tensors = {name: torch.zeros(tokens, dtype=torch.int64, device=device) for name in TOKEN_FIELDS}
        tensors.update(
            req_pool_indices=torch.full((reqs,), padding_row, dtype=torch.int64, device=device),
            seq_lens=torch.ones(reqs, dtype=torch.int64, device=device),
            extend_seq_lens=torch.ones(reqs, dtype=torch.int64, device=device),
            extend_start_loc=torch.arange(reqs, dtype=torch.int64, device=device),
        )
        assert tensors.keys() == {*TOKEN_FIELDS, *REQUEST_FIELDS}
        return cls(tensors)

    def load(self, batch: ForwardBatch, padded: int, padding_row: int) -> None:
        """Copy the live batch into the leading rows. Token rows up to `padded` become token 0 at position 0
        writing slot 0; in decode (one token per request) the padded requests read the padding row of the request
        table with seq_len 1. An extend graph serves one request, so it pads tokens only."""
        tokens, reqs = batch.input_ids.shape[0], batch.batch_size
        for name in TOKEN_FIELDS:
            static = self.tensors[name]
            static[:tokens].copy_(getattr(batch, name))
            static[tokens:padded].zero_()
        for name in REQUEST_FIELDS:
            self.tensors[name][:reqs].copy_(getattr(batch, name))
        if batch.forward_mode.is_decode():
            self.tensors["req_pool_indices"][reqs:padded].fill_(padding_row)
            self.tensors["seq_lens"][reqs:padded].fill_(1)

    def batch(self, mode: ForwardMode, size: int, context_len: int, req_to_token_pool, token_to_kv_pool,
              attn_backend, adapter: bool) -> ForwardBatch:
        """The batch a graph captures: `size` requests for decode, or `size` tokens of one request for extend,
        whose host-side lengths ask the backend for the widest grid (every key chunk a context_len context has).
        An extend's context is longer than its tokens even where `size` reaches context_len, so that the capture
        includes the passes over cached keys (the Triton backend's key staging) that replays with a cached prefix
        need. `adapter`: every row under a span adapter served apart (replays read the rows' switches), or none."""
        if mode.is_decode():
            reqs, seq_lens_cpu, extend_lens_cpu = size, [1] * size, [1] * size
        else:
            reqs, seq_lens_cpu, extend_lens_cpu = 1, [max(context_len, size + 1)], [size]
        views = {name: self.tensors[name][:size] for name in TOKEN_FIELDS}
        views.update({name: self.tensors[name][:reqs] for name in REQUEST_FIELDS})
        return ForwardBatch(
            forward_mode=mode,
            req_pool_indices_cpu=[req_to_token_pool.padding_row] * reqs,
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=extend_lens_cpu,
            positions_cpu=[0] * size,  # the static token rows start at position 0, seeing every key
            attn_lo_cpu=[0] * size,
            span_adapter_rows_cpu=[int(adapter)] * size,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
            attn_backend=attn_backend,
            **views,
        )


class CudaGraphRunner:
    """Captures the model's forward over one request table (`req_to_token_pool`, whose `padding_row` padded
    requests read) and one attention backend, for decode batch sizes and one-request extend sizes."""

    def __init__(
        self,
        runner,
        batch_sizes: list[int],
        extend_sizes: list[int],
        req_to_token_pool,
        attn_backend,
        pool=None,
        shared_members: int | None = None,
    ) -> None:
        """`shared_members`: members_per_item of the engine's shared decode plans, whose graphs are captured too
        (None: only per-request decode graphs)."""
        self.runner = runner
        self.batch_sizes = batch_sizes
        self.extend_sizes = extend_sizes
        self.req_to_token_pool = req_to_token_pool
        self.attn_backend = attn_backend
        pad, dev = req_to_token_pool.padding_row, runner.device
        attn_backend.init_cuda_graph_state(max(batch_sizes, default=0), req_to_token_pool.req_to_token.shape[1])
        self.decode_inputs = StaticInputs.allocate(max(batch_sizes, default=0), max(batch_sizes, default=0), pad, dev)
        self.extend_inputs = StaticInputs.allocate(max(extend_sizes, default=0), 1, pad, dev)
        self.shared_plan = None
        if shared_members is not None and batch_sizes:
            self.shared_plan = StaticSharedPlan.allocate(max(batch_sizes), shared_members, dev)
        self.adapter_variants = adapter_variants(runner.model)
        # (mode, padded size, shared decode, adapter rows) -> graph and its output
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.num_replays = {ForwardMode.DECODE: 0, ForwardMode.EXTEND: 0}
        self.num_shared_replays = 0  # decode replays that read a shared decode plan
        self.num_adapter_replays = 0  # replays of graphs with the span adapter's rows
        self.pool = pool
        self._capture_all()

    @classmethod
    def for_engine(cls, runner) -> CudaGraphRunner:
        """The engine's graphs: decode up to --cuda-graph-max-bs requests, extends up to
        --cuda-graph-max-extend-tokens tokens, over the engine's request table and backend."""
        heads = runner.shared_decode_heads
        return cls(
            runner,
            *engine_capture_sizes(runner),
            runner.req_to_token_pool,
            runner.attn_backend,
            shared_members=members_per_item(heads[0] // heads[1]) if heads is not None else None,
        )

    def _inputs(self, mode: ForwardMode) -> StaticInputs:
        return self.decode_inputs if mode.is_decode() else self.extend_inputs

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Garbage (e.g. graphs of an engine dropped earlier) must not be freed while a capture is open.
        gc.collect()
        torch.cuda.synchronize()
        gc.disable()
        try:
            sized = [(ForwardMode.DECODE, bs, False) for bs in self.batch_sizes]
            if self.shared_plan is not None:
                sized += [(ForwardMode.DECODE, bs, True) for bs in self.batch_sizes]
            sized += [(ForwardMode.EXTEND, n, False) for n in self.extend_sizes]
            keys = [(*key, adapter) for key in sized for adapter in self.adapter_variants]
            stream = torch.cuda.Stream()
            for key in reversed(keys):
                self._capture(key, stream)
            torch.cuda.synchronize()
        finally:
            gc.enable()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s%s and one-request extends of %s tokens%s (%s)",
            self.batch_sizes,
            " (each also with shared decode)" if self.shared_plan is not None else "",
            self.extend_sizes,
            ", each with and without the span adapter's rows" if len(self.adapter_variants) > 1 else "",
            type(self.attn_backend).__name__,
        )

    def _capture_batch(self, mode: ForwardMode, size: int, adapter: bool) -> ForwardBatch:
        """The batch over the static inputs that the graph of (mode, size, adapter rows) is captured with."""
        inputs = self._inputs(mode)
        if not mode.is_decode():
            inputs.tensors["extend_seq_lens"].fill_(size)  # the warm-up runs attend with every row
        return inputs.batch(
            mode,
            size,
            self.runner.model_config.context_len,
            self.req_to_token_pool,
            self.runner.token_to_kv_pool,
            self.attn_backend,
            adapter,
        )

    def _capture(self, key: GraphKey, stream: torch.cuda.Stream) -> None:
        mode, size, shared, adapter = key
        batch = self._capture_batch(mode, size, adapter)
        if shared:
            batch.shared_decode = self.shared_plan.view(size)
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels and settle the allocator before capture
                self.attn_backend.init_forward_metadata_capture(batch, size)
                self.runner.model(batch.input_ids, batch.positions, batch)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        self.attn_backend.init_forward_metadata_capture(batch, size)
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self.runner.model(batch.input_ids, batch.positions, batch)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        self.outputs[key] = out

    def _padded_key(self, batch: ForwardBatch) -> GraphKey | None:
        if batch.probe is not None:  # its layers score the question in Python (layers/attention_probe.py)
            return None
        if batch.span_scaling is not None:  # its ranges size the kernel's loops; no graph was captured with them
            return None
        if batch.deviation is not None:  # it stops after its first layers and scores in Python
            return None
        if batch.forward_mode.is_decode():
            sizes, raw = self.batch_sizes, batch.batch_size
        elif batch.batch_size == 1 and batch.num_decode_tail == 0:
            sizes, raw = self.extend_sizes, batch.input_ids.shape[0]
        else:
            return None
        i = bisect.bisect_left(sizes, raw)
        if i == len(sizes):
            return None
        plan = batch.shared_decode
        shared = plan is not None and self.shared_plan is not None and self.shared_plan.fits(plan, sizes[i])
        adapter = self.adapter_variants[-1] and any(batch.span_adapter_rows_cpu)
        return batch.forward_mode, sizes[i], shared, adapter

    def can_run(self, batch: ForwardBatch) -> bool:
        return self._padded_key(batch) is not None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        key = self._padded_key(batch)
        mode, padded, shared, adapter = key
        self._inputs(mode).load(batch, padded, self.req_to_token_pool.padding_row)
        self.attn_backend.init_forward_metadata_replay(batch, padded, self.req_to_token_pool.padding_row)
        if shared:
            self.shared_plan.load(batch.shared_decode, batch.batch_size, padded)
            self.num_shared_replays += 1
        else:  # the per-request graph runs: the batch records that this step shared no keys (the stats read it)
            batch.shared_decode = None
        self.graphs[key].replay()
        self.num_replays[mode] += 1
        self.num_adapter_replays += adapter
        return self.outputs[key][: batch.input_ids.shape[0]]
