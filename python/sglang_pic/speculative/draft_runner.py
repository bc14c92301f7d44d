"""Draft steps over static draft tables, so that CUDA graphs can replay them.

A draft step is a decode forward of a few tokens over the requests' draft caches. Eager, it launches every kernel
of the model from Python: on the H200 a Llama-3-8B draft step at batch 4 took ~30 ms, three times a graph-replayed
full-KV decode step. Draft tables change every round, so the graphs read static ones instead: `DraftTables` holds
one row per batch position for every layer, and a round copies its DraftBatch in before it drafts. The engine's
backend reads layer l's rows through `LayerTableBackend`, exactly as eager drafting does, so a replay computes what
the eager step would. KIVI's backend also copies each request's prefix length and quantized-tensor addresses into
static buffers of its own (`DraftBackend.load`).

Token-dropping compressors always draft over the static tables, on the CPU too, so CPU tests check the tables
graphs read; KIVI does with the Triton backend (its torch path drafts eagerly on each round's own tables). A round
too wide or too large for the static tables falls back to its own tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from sglang_pic.speculative.draft_cache import DraftBatch

if TYPE_CHECKING:
    from sglang_pic.speculative.compressor_base import Compressor

# Bound on the static tables ([layers, rows, width] int64): they get fewer rows when the full count would pass it.
DRAFT_TABLE_MAX_BYTES = 512 << 20


@dataclass
class DraftTables:
    """tables[l, b, j]: slot of draft index j of batch row b at layer l. The last row stays all zeros (the dummy
    slot) for padded graph rows. Stands in for ReqToTokenPool (`req_to_token`, `padding_row`)."""

    tables: torch.Tensor  # [layers, rows + 1, width] int64

    @property
    def padding_row(self) -> int:
        return self.tables.shape[1] - 1

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.tables[0]

    def fits(self, batch: DraftBatch) -> bool:
        return batch.tables.shape[1] <= self.padding_row and batch.tables.shape[2] <= self.tables.shape[2]

    def load(self, batch: DraftBatch) -> None:
        """Copy a round's tables in (one shared row per request is repeated for every layer). Entries past a row's
        width are stale and never read: a step reads only its seq_len first entries."""
        _, rows, width = batch.tables.shape
        self.tables[:, :rows, :width].copy_(batch.tables.expand(self.tables.shape[0], -1, -1))


class DraftRunner:
    """Runs draft steps over static draft tables through the compressor's static backend, replaying CUDA graphs
    (sharing the engine graphs' memory pool) where the engine has graphs."""

    def __init__(self, runner, width: int, compressor: "Compressor") -> None:
        layers = runner.model_config.num_hidden_layers
        rows = min(runner.server_args.max_running_requests, DRAFT_TABLE_MAX_BYTES // (layers * width * 8) - 1)
        shape = (layers, max(rows, 1) + 1, width)
        self.tables = DraftTables(torch.zeros(shape, dtype=torch.int64, device=runner.device))
        self.backend = compressor.static_draft_backend(runner.attn_backend, self.tables.tables, runner.token_to_kv_pool)
        self.graph_runner = None
        if runner.graph_runner is not None:
            sizes = [bs for bs in runner.graph_runner.batch_sizes if bs <= rows] or capture_batch_sizes(1)
            self.graph_runner = CudaGraphRunner(runner, sizes, [], self.tables, self.backend, runner.graph_runner.pool)

    def load(self, batch: DraftBatch) -> None:
        """Make the static tables and the backend's buffers describe `batch` (which must fit the tables)."""
        self.tables.load(batch)
        self.backend.load(batch)
