"""ForwardBatch's one schema: host rows become a batch in one upload with its derived fields, and pack / unpack
(what tensor parallelism sends) give back every field."""

from __future__ import annotations

import torch

from sglang_pic.forward_batch import (
    HOST_FIELDS,
    HOST_TOKEN_FIELDS,
    REQUEST_FIELDS,
    TOKEN_FIELDS,
    BatchHeader,
    BatchRows,
    ForwardBatch,
    ForwardMode,
)

CPU = torch.device("cpu")


def _batch(rows: BatchRows, **kw) -> ForwardBatch:
    loc = torch.arange(rows.num_tokens) + 100
    return ForwardBatch.build(ForwardMode.EXTEND, rows, loc, CPU, req_to_token_pool=None, token_to_kv_pool=None,
                              attn_backend=None, **kw)


def _rows() -> BatchRows:
    """A span prefill (its tokens see only the span), a chunk of a prompt, then a riding decode."""
    rows = BatchRows(input_ids=[11, 12, 13, 21, 22, 31], logits_indices=[4, 5])
    rows.add(row=3, positions=range(8, 11), attn_lo=[8, 8, 8], seq_len=11)
    rows.add(row=0, positions=[0, 1], attn_lo=[0, 0])
    rows.add(row=5, positions=[40], attn_lo=[0])
    return rows


def test_build_uploads_the_rows_and_derives_the_rest() -> None:
    batch = _batch(_rows(), num_decode_tail=1)
    assert batch.batch_size == 3 and batch.num_decodes == 1
    assert batch.positions.tolist() == [8, 9, 10, 0, 1, 40]
    assert batch.attn_lo.tolist() == batch.attn_lo_cpu == [8, 8, 8, 0, 0, 0]
    assert batch.positions_cpu == [8, 9, 10, 0, 1, 40]
    assert batch.req_pool_indices.tolist() == batch.req_pool_indices_cpu == [3, 0, 5]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu == [11, 2, 41]
    assert batch.extend_seq_lens.tolist() == batch.extend_seq_lens_cpu == [3, 2, 1]
    assert batch.extend_start_loc.tolist() == [0, 3, 5]
    assert batch.logits_indices.tolist() == [4, 5]
    assert batch.out_cache_loc.tolist() == [100, 101, 102, 103, 104, 105]


def test_device_input_ids_replace_the_host_ones() -> None:
    rows = _rows()
    rows.input_ids = []
    ids = torch.tensor([7, 7, 7, 8, 8, 9])
    batch = _batch(rows, input_ids=ids)
    assert batch.input_ids is ids and batch.positions.tolist() == [8, 9, 10, 0, 1, 40]


def test_unpack_gives_back_what_pack_sent() -> None:
    sent = _batch(_rows(), num_decode_tail=1)
    packed, host = sent.pack()
    header = BatchHeader.from_list(sent.header().to_list())
    assert len(sent.header().to_list()) == BatchHeader.size()
    assert packed.numel() == sum(header.device_sizes()) and len(host) == header.host_size()
    got = ForwardBatch.unpack(header, packed, host, req_to_token_pool=None, token_to_kv_pool=None, attn_backend=None)
    assert got.forward_mode == sent.forward_mode and got.num_decode_tail == 1
    for name in TOKEN_FIELDS + REQUEST_FIELDS + ("logits_indices",):
        assert torch.equal(getattr(got, name), getattr(sent, name)), name
    for name in HOST_FIELDS + HOST_TOKEN_FIELDS:
        assert getattr(got, name) == getattr(sent, name), name
