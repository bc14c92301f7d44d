"""CUDA graphs for decode steps: one graph per padded batch size, replayed with the batch copied into static inputs.

Padded rows point at the request table's padding row (every slot 0, the dummy KV slot) with seq_len 1, so they
attend to one harmless key and write their KV into slot 0. The attention backend's decode grid depends only on the
batch size, so one capture serves every context length.
"""

from __future__ import annotations

import bisect
import gc
import logging

import torch

from sglang_pic.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, 257, 16))
    return [bs for bs in sizes if bs <= max_bs] or [1]


class CudaGraphRunner:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.device = runner.device
        max_bs = min(runner.server_args.cuda_graph_max_bs, runner.server_args.max_running_requests)
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        n, dev = self.max_bs, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.attn_lo = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.full((n,), runner.req_to_token_pool.padding_row, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.extend_seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.extend_start_loc = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            attn_lo=self.attn_lo[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_seq_lens=self.extend_seq_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs],
            seq_lens_cpu=[1] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            attn_backend=r.attn_backend,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Garbage (e.g. graphs of an engine dropped earlier) must not be freed while a capture is open.
        gc.collect()
        torch.cuda.synchronize()
        gc.disable()
        try:
            self._capture_each()
        finally:
            gc.enable()

    def _capture_each(self) -> None:
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):
            batch = self._batch(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels and settle the allocator before capture
                    self.runner.attn_backend.init_forward_metadata(batch)
                    self.runner.model(batch.input_ids, batch.positions, batch)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            self.runner.attn_backend.init_forward_metadata(batch)
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.runner.model(batch.input_ids, batch.positions, batch)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode.is_decode() and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        raw = batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, raw)]
        self.input_ids[:raw].copy_(batch.input_ids)
        self.positions[:raw].copy_(batch.positions)
        self.out_cache_loc[:raw].copy_(batch.out_cache_loc)
        self.req_pool_indices[:raw].copy_(batch.req_pool_indices)
        self.seq_lens[:raw].copy_(batch.seq_lens)
        if bs > raw:
            self.input_ids[raw:bs].zero_()
            self.positions[raw:bs].zero_()
            self.out_cache_loc[raw:bs].zero_()
            self.req_pool_indices[raw:bs].fill_(self.runner.req_to_token_pool.padding_row)
            self.seq_lens[raw:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:raw]
