"""The CPU attention backend (torch_native): how it splits a batch before padding it."""

from __future__ import annotations

import torch

from sglang_pic.kernels.paged_batch import decode, extend, forward_batch_for, make_paged_batch, prefill
from sglang_pic.layers.attention_backend import TorchNativeAttnBackend
from sglang_pic.layers.radix_attention import RadixAttention
from sglang_pic.layers.rotary_embedding import RotaryEmbedding


def test_riding_decodes_are_padded_apart_from_the_extends() -> None:
    """A mixed batch's decodes (the tail an ISPS step carries) form a part of one query row each instead of being
    padded to the longest extend; the output equals padding the whole batch together."""
    batch = make_paged_batch(
        [extend(40, 30), prefill(25), decode(5), decode(64), decode(33)], 4, 2, 16, torch.float32, "cpu", page_size=16
    )
    rotary = RotaryEmbedding(16, batch.cos_sin_cache.shape[0])
    layer = RadixAttention(4, 16, batch.sm_scale, 2, layer_id=0, rotary=rotary)
    q, k, v = batch.q.flatten(1), batch.k_new.flatten(1), batch.v_new.flatten(1)
    outs, plans = [], []
    for tail in (3, 0):
        fb = forward_batch_for(batch, TorchNativeAttnBackend(), decode=False, decode_tail=tail)
        fb.attn_backend.init_forward_metadata(fb)
        outs.append(layer(q, k, v, fb))
        plans.append([(reqs.stop - reqs.start, max_q, max_kv) for reqs, _, max_q, max_kv in fb.attn_metadata["parts"]])
    assert plans == [[(2, 30, 40), (3, 1, 64)], [(5, 30, 64)]]
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], outs[1])
