"""CUDA-graph replay emulated on CPU, for the Triton interpreter's engine cases.

A captured graph fixes what the host decides for its batch (the attention backend's metadata, built from the
capture batch's host lists: the model's whole context, the padded token count) and replays the device work over
the live batch, copied into static inputs. `EmulatedGraphs` stands in for the engine's CudaGraphRunner: it runs
the forward over the same static inputs with metadata built from the same capture batch, so a decision a capture
takes that a live batch needs taken otherwise (such as skipping the staging of cached keys) shows on CPU. Device
values the backend computes before a capture are not frozen here, unlike in a real graph.
"""

from __future__ import annotations

import torch

from sglang_pic.forward_batch import ForwardBatch
from sglang_pic.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    StaticInputs,
    adapter_variants,
    engine_capture_sizes,
)


class EmulatedGraphs:
    """The engine's graph runner on CPU: the same batch sizes, padding and capture batches, run eagerly."""

    can_run = CudaGraphRunner.can_run
    _padded_key = CudaGraphRunner._padded_key
    _inputs = CudaGraphRunner._inputs
    _capture_batch = CudaGraphRunner._capture_batch

    def __init__(self, runner) -> None:
        pad = runner.req_to_token_pool.padding_row
        self.runner = runner
        self.req_to_token_pool = runner.req_to_token_pool
        self.attn_backend = runner.attn_backend
        self.batch_sizes, self.extend_sizes = engine_capture_sizes(runner)
        self.decode_inputs = StaticInputs.allocate(self.batch_sizes[-1], self.batch_sizes[-1], pad, runner.device)
        self.extend_inputs = StaticInputs.allocate(max(self.extend_sizes), 1, pad, runner.device)
        self.shared_plan = None  # decodes replay the per-request graph
        self.adapter_variants = adapter_variants(runner.model)
        self.padded: list[tuple[str, int]] = []  # (mode, padded size) of every replay

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        mode, padded, _, adapter = self._padded_key(batch)
        capture = self._capture_batch(mode, padded, adapter)
        self.attn_backend.init_forward_metadata_capture(capture, padded)
        self._inputs(mode).load(batch, padded, self.req_to_token_pool.padding_row)
        batch.shared_decode = None
        self.padded.append((mode.name, padded))
        return self.runner.model(capture.input_ids, capture.positions, capture)[: batch.input_ids.shape[0]]
