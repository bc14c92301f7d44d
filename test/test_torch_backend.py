"""The CPU attention backend (torch_native): how it splits a batch before padding it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sglang_pic.layers.attention_backend import TorchNativeAttnBackend, TorchNativeMetadata
from sglang_pic.layers.radix_attention import RadixAttention
from sglang_pic.layers.rotary_embedding import RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))  # paged_batch, the batch driver

from paged_batch import decode, extend, forward_batch_for, make_paged_batch, prefill  # noqa: E402


def test_requests_are_padded_in_groups_of_like_sizes() -> None:
    """Requests are attended in groups whose new tokens and contexts round up to the same powers of two (a mixed
    batch's decodes apart from its extends, short prefills apart from long contexts); the output equals padding
    the whole batch together."""
    batch = make_paged_batch(
        [extend(40, 30), prefill(25), decode(5), decode(64), decode(33), extend(60, 20)], 4, 2, 16, torch.float32,
        "cpu", page_size=16,
    )
    rotary = RotaryEmbedding(16, batch.cos_sin_cache.shape[0])
    layer = RadixAttention(4, 16, batch.sm_scale, 2, layer_id=0, rotary=rotary)
    q, k, v = batch.q.flatten(1), batch.k_new.flatten(1), batch.v_new.flatten(1)
    fb = forward_batch_for(batch, TorchNativeAttnBackend(), decode=False, decode_tail=3)
    fb.attn_backend.init_forward_metadata(fb)
    groups = [(g.requests.tolist(), g.ext.max_extend_len, g.max_seq_len) for g in fb.attn_metadata.groups]
    assert groups == [([0, 5], 30, 60), ([1], 25, 25), ([2], 1, 5), ([3, 4], 1, 64)]
    grouped = layer(q, k, v, fb)
    fb.attn_metadata = TorchNativeMetadata([TorchNativeAttnBackend.group(fb, list(range(len(batch.seq_lens_cpu))))])
    padded = layer(q, k, v, fb)
    assert not grouped.isnan().any()
    torch.testing.assert_close(grouped, padded)
