"""Triton attention kernels on a CUDA GPU at serving shapes, against the float64 reference.

Llama-3-8B-like heads (32 query / 8 kv heads, head_dim 128), pages of 16 slots laid out in random order, contexts
from 1 to 32K and batches up to 256. Every run gets fresh random inputs and a NaN-poisoned output; any NaN left
fails (an unwritten row or a read of a slot the request does not own, which the pool fills with NaN).
Run: pytest -m gpu test/test_kernels_gpu.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))  # paged_batch, the batch driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HQ, HKV, DIM, PAGE = 32, 8, 128, 16
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
ROW_SLACK = 4.0


def _ragged(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def _variant(keys_rotated: bool) -> str:
    return "prerotated" if keys_rotated else "position_free"


def _check(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype) -> None:
    from sglang_pic.kernels.reference import relative_errors

    assert not out.isnan().any(), "NaN in the output: a row was not written or a foreign slot was read"
    whole, worst_row = relative_errors(out, expect)
    tol = TOLERANCE[dtype]
    assert whole < tol, f"relative error {whole:.2e} >= {tol:.0e}"
    assert worst_row < ROW_SLACK * tol, f"worst row relative error {worst_row:.2e}"


def _batch(specs, dtype, seed, **kw):
    from paged_batch import make_paged_batch

    return make_paged_batch(specs, HQ, HKV, DIM, dtype, "cuda", page_size=PAGE, seed=seed, rope_base=5e5, **kw)


DECODE_CASES = {
    "b1_ctx32k": ([32768], torch.bfloat16),
    "b8_ctx4k_16k": (_ragged(8, 4096, 16384, 1), torch.bfloat16),
    "b64_ctx1k_4k": (_ragged(64, 1024, 4096, 2), torch.bfloat16),
    "b256_ctx512_2k": (_ragged(256, 512, 2048, 3), torch.bfloat16),
    "b16_ctx1_300": ([1, 2, 15, 16, 17, 63, 64, 65, 255, 256, 257, 300, 3, 100, 200, 128], torch.bfloat16),
    "b32_ctx8k_fp16": (_ragged(32, 6000, 8192, 4), torch.float16),
    "b4_ctx2k_fp32": (_ragged(4, 1000, 2048, 5), torch.float32),
}


DECODE_RUNS = [(case, False) for case in DECODE_CASES] + [("b8_ctx4k_16k", True), ("b16_ctx1_300", True)]


@pytest.mark.parametrize("case,keys_rotated", DECODE_RUNS, ids=[f"{c}-{_variant(r)}" for c, r in DECODE_RUNS])
def test_decode(case: str, keys_rotated: bool) -> None:
    from sglang_pic.kernels.decode_attention import num_kv_splits
    from paged_batch import decode
    from sglang_pic.kernels.reference import attention_reference

    lens, dtype = DECODE_CASES[case]
    batch = _batch([decode(n) for n in lens], dtype, seed=len(lens))
    k_buffer = batch.rotated_pool() if keys_rotated else batch.k_buffer
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = batch.run_decode(num_kv_splits(len(lens), HKV, sms), keys_rotated=keys_rotated, k_buffer=k_buffer)
    _check(out, attention_reference(*batch.attention_args(k_buffer), keys_rotated=keys_rotated), dtype)


SHARED_DECODE_CASES = {
    # (preface lengths, shared span length, private tail): every request holds the span at its own offset
    "b64_span4k": (_ragged(64, 10, 600, 41), 4096, 64),
    "b8_span16k": (_ragged(8, 1, 3000, 42), 16384, 300),
    "b200_span1100": (_ragged(200, 0, 50, 43), 1100, 1),
}


@pytest.mark.parametrize("case", list(SHARED_DECODE_CASES))
def test_shared_decode(case: str) -> None:
    """The shared kernel with the engine's settings (chunks, member tiles) against the float64 reference."""
    from paged_batch import decode
    from sglang_pic.kernels.reference import attention_reference
    from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings

    prefaces, span, tail = SHARED_DECODE_CASES[case]
    lens = [n + span + tail for n in prefaces]
    batch = _batch([decode(n) for n in lens], torch.bfloat16, seed=len(lens))
    runs = batch.share_keys([(0, prefaces[0], span, list(enumerate(prefaces))[1:])])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    settings = SharedDecodeSettings.for_model(HQ, HKV, sms, batch.q.device)
    out = batch.run_shared_decode(runs, settings)
    _check(out, attention_reference(*batch.attention_args()), torch.bfloat16)


def _extend_specs(case: str) -> list:
    from paged_batch import extend, prefill, spans

    return {
        "prefill_8k": [prefill(8192)],
        "prefill_ragged": [prefill(1024), prefill(3000), prefill(17), prefill(2048)],
        "prefix_extend": [extend(4096, 1024), extend(3000, 1000), extend(9000, 1), extend(700, 129)],
        "chunked_prefill": [extend(6144, 2048), extend(16384, 512)],
        "spans_and_pdep": [
            spans(6144, [(100, 1100), (2000, 3500), (4000, 4100)], 512),
            spans(8192, [(0, 4000)], 64),
            spans(2500, [(7, 9), (1000, 2400)], 1),
        ],
    }[case]


EXTEND_CASES = ["prefill_8k", "prefill_ragged", "prefix_extend", "chunked_prefill", "spans_and_pdep"]
# (case, dtype, keys_rotated, stage): position-free keys both rotated in-kernel and staged (rotated once).
EXTEND_RUNS = [(case, torch.bfloat16, False, stage) for case in EXTEND_CASES for stage in (False, True)] + [
    (case, dtype, rotated, False)
    for case in ("prefix_extend", "spans_and_pdep")
    for dtype, rotated in ((torch.float16, False), (torch.bfloat16, True))
]


@pytest.mark.parametrize(
    "case,dtype,keys_rotated,stage",
    EXTEND_RUNS,
    ids=[f"{c}-{str(d).split('.')[-1]}-{_variant(r)}{'-staged' if st else ''}" for c, d, r, st in EXTEND_RUNS],
)
def test_extend(case: str, dtype: torch.dtype, keys_rotated: bool, stage: bool) -> None:
    from sglang_pic.kernels.reference import attention_reference

    batch = _batch(_extend_specs(case), dtype, seed=EXTEND_CASES.index(case))
    k_buffer = batch.rotated_pool() if keys_rotated else batch.k_buffer
    out = batch.run_extend(keys_rotated=keys_rotated, k_buffer=k_buffer, stage=stage)
    _check(out, attention_reference(*batch.attention_args(k_buffer), keys_rotated=keys_rotated), dtype)


FP8_RUNS = [("decode", "b256_ctx512_2k"), ("decode", "b8_ctx4k_16k"), ("shared", "b64_span4k"),
            ("extend", "spans_and_pdep"), ("staged", "prefix_extend")]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kernel,case", FP8_RUNS, ids=[f"{k}-{c}" for k, c in FP8_RUNS])
def test_fp8_pool(kernel: str, case: str, kv_dtype: torch.dtype) -> None:
    """bf16 queries over an fp8 pool (--kv-cache-dtype): the reference reads the same fp8 values."""
    from paged_batch import decode
    from sglang_pic.kernels.decode_attention import num_kv_splits
    from sglang_pic.kernels.reference import attention_reference
    from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if kernel == "decode":
        lens = DECODE_CASES[case][0]
        batch = _batch([decode(n) for n in lens], torch.bfloat16, seed=len(lens), kv_dtype=kv_dtype)
        out = batch.run_decode(num_kv_splits(len(lens), HKV, sms))
    elif kernel == "shared":
        prefaces, span, tail = SHARED_DECODE_CASES[case]
        lens = [n + span + tail for n in prefaces]
        batch = _batch([decode(n) for n in lens], torch.bfloat16, seed=len(lens), kv_dtype=kv_dtype)
        runs = batch.share_keys([(0, prefaces[0], span, list(enumerate(prefaces))[1:])])
        out = batch.run_shared_decode(runs, SharedDecodeSettings.for_model(HQ, HKV, sms, batch.q.device))
    else:
        batch = _batch(_extend_specs(case), torch.bfloat16, seed=EXTEND_CASES.index(case), kv_dtype=kv_dtype)
        out = batch.run_extend(stage=kernel == "staged")
    _check(out, attention_reference(*batch.attention_args()), torch.bfloat16)


@pytest.mark.parametrize("num_splits", [None, 7], ids=["engine_choice", "forced"])
def test_extend_few_tokens_over_long_context(num_splits: int | None) -> None:
    """Questions behind long cached spans: few query blocks, so the key range is split and merged."""
    from paged_batch import extend
    from sglang_pic.kernels.reference import attention_reference

    specs = [extend(32768, 40), extend(20000, 37)]
    batch = _batch(specs, torch.bfloat16, seed=21)
    _check(batch.run_extend(num_splits=num_splits), attention_reference(*batch.attention_args()), torch.bfloat16)


def test_extend_fp32_small() -> None:
    from paged_batch import extend, spans
    from sglang_pic.kernels.reference import attention_reference

    batch = _batch([extend(700, 300), spans(900, [(50, 400)], 20)], torch.float32, seed=11)
    _check(batch.run_extend(), attention_reference(*batch.attention_args()), torch.float32)


@pytest.mark.parametrize("rotate", [False, True], ids=["unrotated", "rotated"])
def test_store_kv(rotate: bool) -> None:
    from paged_batch import extend, prefill
    from sglang_pic.kernels.reference import relative_errors, store_reference

    batch = _batch([prefill(3000), extend(5000, 1096)], torch.bfloat16, seed=21)
    k_buf, v_buf = batch.run_store(rotate)
    loc = batch.out_cache_loc
    k_exp = torch.full_like(k_buf, float("nan"))
    v_exp = torch.full_like(v_buf, float("nan"))
    rotation = (batch.positions, batch.cos_sin_cache) if rotate else ()
    store_reference(k_exp, v_exp, loc, batch.k_new, batch.v_new, *rotation)
    untouched = torch.ones(k_buf.shape[0], dtype=torch.bool, device=k_buf.device)
    untouched[loc] = False
    assert k_buf[untouched].isnan().all() and v_buf[untouched].isnan().all(), "wrote outside out_cache_loc"
    assert torch.equal(v_buf[loc], v_exp[loc])
    if rotate:  # fp32 rotation vs float64: the bf16 results differ by at most one rounding step
        assert relative_errors(k_buf[loc], k_exp[loc])[0] < 3e-3
    else:
        assert torch.equal(k_buf[loc], k_exp[loc])


def test_decode_cuda_graph_replay_with_new_lengths() -> None:
    """The decode grid depends only on batch size and split count: a graph captured at short contexts must give
    exact-length results when replayed after seq_lens grew (and q changed)."""
    from sglang_pic.kernels.decode_attention import alloc_decode_buffers, num_kv_splits
    from paged_batch import decode
    from sglang_pic.kernels.reference import attention_reference

    long_lens = _ragged(24, 3000, 12000, 31)
    batch = _batch([decode(n) for n in long_lens], torch.bfloat16, seed=31)
    bsz = len(long_lens)
    splits = num_kv_splits(bsz, HKV, torch.cuda.get_device_properties(0).multi_processor_count)
    buffers = alloc_decode_buffers(bsz, HQ, DIM, splits, batch.q.device)
    out = batch.poisoned_output()
    short = torch.tensor([max(1, n // 50) for n in long_lens], device="cuda")
    long = batch.seq_lens.clone()

    batch.seq_lens.copy_(short)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        batch.run_decode(splits, out=out, buffers=buffers)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch.run_decode(splits, out=out, buffers=buffers)

    for lens in (short, long):
        batch.seq_lens.copy_(lens)
        batch.positions.copy_(lens - 1)
        batch.q.copy_(torch.randn_like(batch.q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, attention_reference(*batch.attention_args()), torch.bfloat16)


@pytest.mark.parametrize("decode_mode", [False, True], ids=["extend", "decode"])
def test_triton_backend_matches_reference(decode_mode: bool) -> None:
    from paged_batch import decode, extend, forward_batch_for, spans
    from sglang_pic.kernels.reference import attention_reference
    from sglang_pic.layers.triton_backend import TritonAttnBackend
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.layers.rotary_embedding import RotaryEmbedding

    if decode_mode:
        specs = [decode(n) for n in _ragged(40, 1, 9000, 41)]
    else:
        specs = [extend(5000, 700), spans(4000, [(1000, 2500)], 33)]
    batch = _batch(specs, torch.bfloat16, seed=41)
    expect = attention_reference(*batch.attention_args())
    rotary = RotaryEmbedding(DIM, batch.cos_sin_cache.shape[0], base=5e5, device="cuda")
    layer = RadixAttention(HQ, DIM, batch.sm_scale, HKV, layer_id=0, rotary=rotary)
    backend = TritonAttnBackend()
    fb = forward_batch_for(batch, backend, decode_mode)
    backend.init_forward_metadata(fb)
    out = layer(batch.q.flatten(1), batch.k_new.flatten(1), batch.v_new.flatten(1), fb)
    _check(out.view(expect.shape), expect, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_and_activation_kernels_match_torch_ops(dtype: torch.dtype) -> None:
    """The CUDA layers' RMSNorm (alone and with the residual add) and SiLU-and-mul kernels against the torch ops of
    their CPU path, at Llama-3-8B widths and batch sizes 1..300, within two units of the last place: each output is
    rounded twice (the normalized value or the SiLU, then the product), and the kernels' rsqrt and exp differ from
    torch's in the last float32 bits, which can move the first rounding by one unit."""
    import torch.nn.functional as F

    from sglang_pic.layers.activation import GatedAct
    from sglang_pic.layers.layernorm import RMSNorm

    tolerance = 2 * {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[dtype]  # two units

    def worst(got: torch.Tensor, want: torch.Tensor) -> float:
        got, want = got.double(), want.double()
        return float(((got - want).abs() / want.abs().clamp(min=1.0)).max())

    norm = RMSNorm(4096, eps=1e-5).to("cuda", dtype)
    act = GatedAct("silu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(4096) * 0.5 + 1.0)
        for tokens in (1, 37, 300):
            x = torch.randn(tokens, 4096, device="cuda", dtype=dtype) * 3
            residual = torch.randn_like(x)
            fused, summed = norm(x, residual)
            assert torch.equal(summed, x + residual)
            assert worst(fused, norm._norm(x + residual)) <= tolerance
            assert worst(norm(x), norm._norm(x)) <= tolerance
            gate_up = torch.randn(tokens, 2 * 14336, device="cuda", dtype=dtype) * 4
            gate, up = gate_up.chunk(2, dim=-1)
            assert worst(act(gate_up), F.silu(gate) * up) <= tolerance
