"""Tensor parallelism's control path: rank 0 sends every ForwardBatch it runs to the other ranks, which run the same
forward (so their collectives pair up with rank 0's) and drop the logits.

Per step, three broadcasts from rank 0: a fixed-size header on the gloo group (idle followers wait on it), the
batch's host lists (and a probe pass's question rows) on the gloo group, and one int64 payload on the device group holding the batch tensors (laid out
by ForwardBatch.pack), the req_to_token entries the batch reads (row req_pool_index, columns 0..seq_len-1 of each
request) and the shared decode plan, if any. A follower
writes those entries into its own table before the forward, so its attention reads exactly rank 0's KV slot
indices; the scheduler, radix cache and allocator exist on rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from sglang_pic.forward_batch import BatchHeader, ForwardBatch
from sglang_pic.kernels.paged_layout import SpanScaling
from sglang_pic.kernels.shared_decode_plan import ITEM_FIELDS, MEMBER_FIELDS, SharedDecodePlan
from sglang_pic.layers.attention_probe import AttentionProbe
from sglang_pic.layers.deviation_probe import DeviationProbe

I64 = torch.int64


class Op(IntEnum):
    FORWARD = 1
    STOP = 2
    LOAD_WEIGHTS = 3


@dataclass(frozen=True)
class LoadWeights:
    """Rank 0's order to load every rank's shard of the checkpoint in `folder` (update_weights_from_disk)."""

    folder: str


PLAN_SIZES = 4  # SharedDecodePlan.sizes()
# op, the BatchHeader, req_to_token entries R, the integers of the probe, of the span scaling (in the device
# payload) and its number of groups, of the deviation probe, then the shared decode plan's sizes (zeros without one)
HEADER_LEN = 1 + BatchHeader.size() + 5 + PLAN_SIZES


def scaling_to_tensor(scaling: SpanScaling) -> torch.Tensor:
    """A batch's span scaling as one int64 tensor on its device: range starts, ranges, their groups, then their
    temperatures and scales as float32 bits (num_groups travels in the header). It travels in the device payload:
    read back to the host it would make rank 0 wait on the device every step."""
    factors = torch.cat([scaling.temperature, scaling.scale]).float().view(torch.int32).long()
    return torch.cat([scaling.range_start, scaling.ranges.flatten(), scaling.group, factors])


def scaling_from_tensor(values: torch.Tensor, batch_size: int, num_groups: int) -> SpanScaling:
    starts, rest = values[: batch_size + 1], values[batch_size + 1 :]
    n = rest.shape[0] // 5  # ranges: two ints, a group and two factors each
    factors = rest[3 * n :].int().view(torch.float32)
    return SpanScaling(rest[: 2 * n].view(-1, 2), starts, rest[2 * n : 3 * n], factors[:n], factors[n:], num_groups)


def table_index(
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of req_to_token entries 0..seq_len-1 of each request, `total` = sum(seq_lens) entries."""
    rows = torch.repeat_interleave(req_pool_indices, seq_lens, output_size=total)
    starts = torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens, output_size=total)
    return rows, torch.arange(total, dtype=I64, device=seq_lens.device) - starts


class BatchBroadcaster:
    """Rank 0's side."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.cpu_group = runner.tp.cpu_group
        self.device_group = runner.tp.device_group

    def send(self, batch: ForwardBatch) -> None:
        entries = sum(batch.seq_lens_cpu)
        shared = batch.shared_decode
        plan_sizes = shared.sizes() if shared is not None else (0,) * PLAN_SIZES
        probe = batch.probe.to_list() if batch.probe is not None else []
        scaling = [scaling_to_tensor(batch.span_scaling)] if batch.span_scaling is not None else []
        groups = batch.span_scaling.num_groups if batch.span_scaling is not None else 0
        deviation = batch.deviation.to_list() if batch.deviation is not None else []
        header = [Op.FORWARD, *batch.header().to_list(), entries, len(probe), sum(t.numel() for t in scaling),
                  groups, len(deviation), *plan_sizes]
        dist.broadcast(torch.tensor(header, dtype=I64), 0, group=self.cpu_group)
        tensors, host = batch.pack()
        dist.broadcast(torch.tensor(host + probe + deviation, dtype=I64), 0, group=self.cpu_group)
        rows, cols = table_index(batch.req_pool_indices, batch.seq_lens, entries)
        table = batch.req_to_token_pool.req_to_token[rows, cols]
        payload = torch.cat([tensors, table, *([shared.flat()] if shared is not None else []), *scaling])
        dist.broadcast(payload, 0, group=self.device_group)

    def load_weights(self, folder: str) -> None:
        self._send_op(Op.LOAD_WEIGHTS)
        dist.broadcast_object_list([folder], 0, group=self.cpu_group)

    def stop(self) -> None:
        self._send_op(Op.STOP)

    def _send_op(self, op: Op) -> None:
        """A header that carries no batch, only `op`."""
        header = torch.zeros(HEADER_LEN, dtype=I64)
        header[0] = op
        dist.broadcast(header, 0, group=self.cpu_group)


class BatchReceiver:
    """A follower's side: `recv()` blocks for rank 0's next batch (or weights to load); None once rank 0 stops."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.cpu_group = runner.tp.cpu_group
        self.device_group = runner.tp.device_group

    def recv(self) -> ForwardBatch | LoadWeights | None:
        header = torch.empty(HEADER_LEN, dtype=I64)
        dist.broadcast(header, 0, group=self.cpu_group)
        op, *values = header.tolist()
        if op == Op.STOP:
            return None
        if op == Op.LOAD_WEIGHTS:
            folder = [None]
            dist.broadcast_object_list(folder, 0, group=self.cpu_group)
            return LoadWeights(folder[0])
        shape = BatchHeader.from_list(values[: BatchHeader.size()])
        entries, probe_len, scaling_len, span_groups, deviation_len, *plan_sizes = values[BatchHeader.size() :]
        host = torch.empty(shape.host_size() + probe_len + deviation_len, dtype=I64)
        dist.broadcast(host, 0, group=self.cpu_group)
        host = host.tolist()
        num_items, num_members = plan_sizes[:2]
        decodes = shape.batch_size if shape.mode.is_decode() else shape.num_decode_tail
        plan_len = (num_items * ITEM_FIELDS + num_members * MEMBER_FIELDS + decodes + 1) if num_items else 0
        sizes = [sum(shape.device_sizes()), entries, plan_len, scaling_len]
        payload = torch.empty(sum(sizes), dtype=I64, device=self.runner.device)
        dist.broadcast(payload, 0, group=self.device_group)
        tensors, slots, plan, scaling = payload.split(sizes)
        runner = self.runner
        batch = ForwardBatch.unpack(
            shape, tensors, host[: shape.host_size()], req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool, attn_backend=runner.attn_backend,
            shared_decode=SharedDecodePlan.from_flat(plan, tuple(plan_sizes)) if num_items else None,
        )
        probe_end = shape.host_size() + probe_len
        if probe_len:
            batch.probe = AttentionProbe.from_list(host[shape.host_size() : probe_end], runner.device)
        if scaling_len:
            batch.span_scaling = scaling_from_tensor(scaling, shape.batch_size, span_groups)
        if deviation_len:
            batch.deviation = DeviationProbe.from_list(host[probe_end:], runner.device)
        rows, cols = table_index(batch.req_pool_indices, batch.seq_lens, entries)
        runner.req_to_token_pool.req_to_token[rows, cols] = slots
        return batch
