"""The Triton interpreter kernel cases: each builds a small batch or backend, runs a kernel path on CPU and returns
a JSON-able dict of measurements (errors against a float64 reference or torch_native, flags) that
test_kernels_triton.py asserts on; the cases that run whole engines come from triton_engine_cases.py. Imported only
by the interpreter worker (triton_worker.py), which sets TRITON_INTERPRET=1 before triton is first imported.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from sglang_pic.kernels.paged_layout import SpanScaling
from sglang_pic.kernels.reference import attention_reference, relative_errors, store_reference
from sglang_pic.kernels.torch_native import paged_attention_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))  # paged_batch, the batch driver

import paged_batch as pb  # noqa: E402
from triton_engine_cases import ENGINE_CASES  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attention_case(
    specs: list[pb.RequestSpec],
    hq: int,
    hkv: int,
    dim: int,
    dtype: str,
    *,
    page: int = 1,
    decode: bool = False,
    keys_rotated: bool = False,
    splits: int = 4,
    extend_splits: int | None = None,
    stage: bool = False,
    shares: list | None = None,
    members: int = 2,
    span_ranges: list[list[tuple[int, int]]] | None = None,
    span_groups: list[list[int]] | None = None,
    **kw,
) -> dict:
    batch = pb.make_paged_batch(specs, hq, hkv, dim, DTYPES[dtype], "cpu", page_size=page, **kw)
    span = None if span_ranges is None else span_scaling(span_ranges, span_groups)
    if keys_rotated:
        batch.k_buffer = batch.rotated_pool()
    if shares is not None:  # decodes holding the same slots at different offsets, through the shared kernel
        from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings

        settings = SharedDecodeSettings(members=members, min_chunk=8, target_items=12, max_read=1.0)
        out = batch.run_shared_decode(batch.share_keys(shares), settings)
    elif decode:
        out = batch.run_decode(splits, keys_rotated=keys_rotated)
    else:
        out = batch.run_extend(keys_rotated=keys_rotated, num_splits=extend_splits, stage=stage, span=span)
    args = batch.attention_args()
    return {
        "dtype": dtype,
        "nan": bool(out.isnan().any()),
        "vs_reference": relative_errors(out, attention_reference(*args, keys_rotated=keys_rotated, span=span)),
        "vs_torch_native": relative_errors(out, paged_attention_torch(*args, keys_rotated=keys_rotated, span=span)),
    }


def span_scaling(ranges: list[list[tuple[int, int]]], groups: list[list[int]] | None = None) -> SpanScaling:
    """APE's scaling over each request's span `ranges`, in its `groups` (default: one per request), with a
    temperature and scale of their own per group."""
    flat = [r for request in ranges for r in request]
    groups = [[0] * len(request) for request in ranges] if groups is None else groups
    starts, group_ids, pairs = [0], [], []
    for b, request in enumerate(groups):
        starts.append(starts[-1] + len(request))
        group_ids += request
        pairs += [(b, g) for g in request]
    distinct = sorted(set(pairs))
    temperature, scale = torch.linspace(0.5, 1.0, len(distinct)), torch.linspace(1.5, 0.8, len(distinct))
    which = torch.tensor([distinct.index(p) for p in pairs], dtype=torch.int64)
    return SpanScaling(torch.tensor(flat, dtype=torch.int64).view(-1, 2), torch.tensor(starts),
                       torch.tensor(group_ids, dtype=torch.int64), temperature[which], scale[which],
                       max(group_ids, default=-1) + 1)


def store_case(
    dtype: str, rotate: bool, page: int, kv_dtype: torch.dtype | None = None, magnitude: float = 1.0
) -> dict:
    """The store into a pool of `kv_dtype` (default: `dtype`) of new keys and values `magnitude` times the batch's
    (large ones saturate an fp8 pool), against the reference store."""
    specs = [pb.prefill(19), pb.extend(40, 7), pb.spans(30, [(4, 9)], 2)]
    batch = pb.make_paged_batch(specs, 4, 2, 32, DTYPES[dtype], "cpu", page_size=page, kv_dtype=kv_dtype)
    batch.k_new, batch.v_new = batch.k_new * magnitude, batch.v_new * magnitude
    k_buf, v_buf = batch.run_store(rotate)
    k_exp, v_exp = (torch.full(b.shape, float("nan")).to(b) for b in (k_buf, v_buf))  # fp8 pools take no fill
    loc = batch.out_cache_loc
    rotation = (batch.positions, batch.cos_sin_cache) if rotate else ()
    store_reference(k_exp, v_exp, loc, batch.k_new, batch.v_new, *rotation)
    # fp8 tensors take no isnan or equal: compare widened (exact)
    k_buf, v_buf, k_exp, v_exp = (t.float() for t in (k_buf, v_buf, k_exp, v_exp))
    untouched = torch.ones(k_buf.shape[0], dtype=torch.bool)
    untouched[loc] = False
    return {
        "dtype": dtype,
        "nan": bool(k_buf[loc].isnan().any() or v_buf[loc].isnan().any()),
        "others_untouched": bool(k_buf[untouched].isnan().all() and v_buf[untouched].isnan().all()),
        "v_exact": bool(torch.equal(v_buf[loc], v_exp[loc])),
        "k_exact": bool(torch.equal(k_buf[loc], k_exp[loc])),
        "vs_reference": relative_errors(k_buf[loc], k_exp[loc]),
    }


def backend_case(
    decode: bool, page: int, mixed: bool = False, long_prefill: bool = False, shared: bool = False
) -> dict:
    """`long_prefill` adds a 160-token prefill: 320 query rows per kv head, past FEW_QUERY_ROWS, so the backend
    stages the batch's keys; the other extend batches have few rows and rotate keys in-kernel. `shared`: the
    riding decodes hold a run of the same slots and the batch carries a shared decode plan."""
    from sglang_pic.layers.attention_backend import TorchNativeAttnBackend
    from sglang_pic.layers.triton_backend import TritonAttnBackend
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.layers.rotary_embedding import RotaryEmbedding

    hq, hkv, dim = 4, 2, 32
    specs = [pb.decode(n) for n in (3, 40, 77)] if decode else [pb.extend(30, 9), pb.spans(50, [(8, 20)], 4)]
    if long_prefill:
        specs.append(pb.prefill(160))
    decode_tail = 3 if mixed else 0
    if mixed:  # running decodes riding along with prefills: the backend gives them to the decode kernel
        specs += [pb.decode(n) for n in (5, 64, 33)]
    batch = pb.make_paged_batch(specs, hq, hkv, dim, torch.float32, "cpu", page_size=page)
    plan = None
    if shared:
        from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings, plan_shared_decode

        first = len(specs) - decode_tail
        runs = batch.share_keys([(first + 1, 16, 16, [(first + 2, 10)])])[first:]
        rows = batch.req_pool_indices.tolist()[first:]
        settings = SharedDecodeSettings(members=2, min_chunk=8, target_items=8, max_read=1.0)
        plan = plan_shared_decode(rows, batch.seq_lens_cpu[first:], runs, settings, "cpu")
    rotary = RotaryEmbedding(dim, batch.cos_sin_cache.shape[0])
    layer = RadixAttention(hq, dim, batch.sm_scale, hkv, layer_id=0, rotary=rotary)
    q, k, v = batch.q.flatten(1), batch.k_new.flatten(1), batch.v_new.flatten(1)
    outs, batches = [], []
    for backend in (TritonAttnBackend(), TorchNativeAttnBackend()):
        batches.append(pb.forward_batch_for(batch, backend, decode, decode_tail))
        batches[-1].shared_decode = plan
        backend.init_forward_metadata(batches[-1])
        outs.append(layer(q, k, v, batches[-1]))
    return {
        "dtype": "float32",
        "nan": bool(outs[0].isnan().any()),
        "vs_torch_native": relative_errors(*outs),
        "staged": batches[0].attn_metadata.staged is not None,
    }


def graph_padding_case(spec: pb.RequestSpec, padded: int, context_len: int = 4096) -> dict:
    """A one-request extend padded as its CUDA graph replays it: the backend is sized for the model's
    `context_len` and the padded count, the live rows keep their output and the padded rows write only the dummy
    slot 0 (and, when the keys are staged, no workspace row: they would overwrite the new keys' rotated copies)."""
    from sglang_pic.forward_batch import ForwardMode
    from sglang_pic.layers.attention_backend import TorchNativeAttnBackend
    from sglang_pic.layers.triton_backend import TritonAttnBackend
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.layers.rotary_embedding import RotaryEmbedding
    from sglang_pic.model_executor.cuda_graph_runner import StaticInputs

    hq, hkv, dim = 4, 2, 32
    batch = pb.make_paged_batch([spec], hq, hkv, dim, torch.float32, "cpu", page_size=16)
    layer = RadixAttention(hq, dim, batch.sm_scale, hkv, layer_id=0, rotary=RotaryEmbedding(dim, context_len))
    q, k, v = batch.q.flatten(1), batch.k_new.flatten(1), batch.v_new.flatten(1)
    native = pb.forward_batch_for(batch, TorchNativeAttnBackend(), decode=False)
    native.attn_backend.init_forward_metadata(native)
    expected = layer(q, k, v, native)

    live = pb.forward_batch_for(batch, TritonAttnBackend(), decode=False)
    static = StaticInputs.allocate(padded, 1, live.req_to_token_pool.padding_row, torch.device("cpu"))
    static.load(live, padded, live.req_to_token_pool.padding_row)
    graph_batch = static.batch(
        ForwardMode.EXTEND, padded, context_len, live.req_to_token_pool, live.token_to_kv_pool, live.attn_backend,
        adapter=False,
    )
    graph_batch.attn_backend.init_forward_metadata(graph_batch)
    rows = q.shape[0]
    garbage = [torch.randn(padded - rows, t.shape[1]) for t in (q, k, v)]
    k_pool = live.token_to_kv_pool.k_buffer[0]
    before = k_pool.clone()
    out = layer(*(torch.cat([t, g]) for t, g in zip((q, k, v), garbage)), graph_batch)
    same = (k_pool == before) | (k_pool.isnan() & before.isnan())
    written = set((~same.flatten(1).all(1)).nonzero().flatten().tolist())
    return {
        "dtype": "float32",
        "nan": bool(out[:rows].isnan().any()),
        "vs_torch_native": relative_errors(out[:rows], expected),
        "writes_only_own_and_dummy_slots": written <= set(batch.out_cache_loc.tolist()) | {0},
        "key_splits": graph_batch.attn_metadata.max_seq_len >= context_len,
        "staged": graph_batch.attn_metadata.staged is not None,
    }


def stage_decision_case() -> dict:
    from sglang_pic.kernels.stage_keys import FEW_QUERY_ROWS, STAGE_MAX_BYTES, should_stage_keys

    key = torch.empty((1, 8, 128), dtype=torch.bfloat16, device="meta")  # rows of 8 kv heads x 128 dims
    bound = STAGE_MAX_BYTES // (8 * 128 * 2)
    many = FEW_QUERY_ROWS + 1
    return {
        "no_keys": should_stage_keys(0, key, many, torch.bfloat16),
        "prefill_8k": should_stage_keys(8192, key, many, torch.bfloat16),
        "at_bound": should_stage_keys(bound, key, many, torch.bfloat16),
        "over_bound": should_stage_keys(bound + 1, key, many, torch.bfloat16),
        "few_queries": should_stage_keys(8192, key, FEW_QUERY_ROWS, torch.bfloat16),
    }


def warm_up_case() -> dict:
    """The backend's startup warm-up on CPU tensors: one launch per extend variant plus decode, writing only
    the dummy slot 0 of the pool."""
    from sglang_pic.kernels.extend_attention import extend_variants
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.layers.rotary_embedding import RotaryEmbedding
    from sglang_pic.layers.triton_backend import TritonAttnBackend
    from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    torch.manual_seed(3)
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 32, 1, "cpu")
    k_buf, v_buf = pool.get_kv_buffer(0)
    k_buf.normal_(), v_buf.normal_()
    before = k_buf.clone(), v_buf.clone()
    layer = RadixAttention(8, 32, 32**-0.5, 2, layer_id=0, rotary=RotaryEmbedding(32, 512))
    launches = TritonAttnBackend().warm_up(layer, pool, ReqToTokenPool(4, 512, "cpu"), torch.float32)
    variants = extend_variants(4, 32, torch.float32, torch.device("cpu"))
    # one kv head per query head and a 200-token context: no request reaches the 257 rows that staging needs
    mha = RadixAttention(2, 32, 32**-0.5, 2, layer_id=0, rotary=RotaryEmbedding(32, 200))
    short_context_launches = TritonAttnBackend().warm_up(mha, pool, ReqToTokenPool(4, 200, "cpu"), torch.float32)
    # The GPU's long-context tiles launch over a context longer than the new tokens (the CPU has one tile, so its
    # own list has none): the same launches, in-kernel and staged, over 300 keys.
    import sglang_pic.layers.triton_backend as backend_module

    gpu_like = [(3, 300, False, 1), (3, 300, False, 2), (70, 300, True, 1), (70, 300, True, 2)]
    own = backend_module.extend_variants
    backend_module.extend_variants = lambda *args: gpu_like
    try:
        long_context_launches = TritonAttnBackend().warm_up(layer, pool, ReqToTokenPool(4, 512, "cpu"), torch.float32)
    finally:
        backend_module.extend_variants = own
    return {
        "short_context_launches": short_context_launches,
        "long_context_launches": long_context_launches,
        "launches": launches,
        "variants": len(variants),
        "staged_variants": sum(staged for _, _, staged, _ in variants),
        "only_dummy_slot_written": bool(k_buf[1:].equal(before[0][1:]) and v_buf[1:].equal(before[1][1:])),
    }


def warm_up_coverage_case() -> dict:
    """Every extend kernel variant a GPU batch can launch (any new-token count up to 4096 over a context as long
    or up to 4096 keys longer, keys staged or rotated in-kernel, key range split or not) has the constexprs of one
    the warm-up launches."""
    from sglang_pic.kernels.extend_attention import SHORT_CONTEXT_KEYS, extend_kernel_params, extend_variants
    from sglang_pic.kernels.rope import HeadSplit
    from sglang_pic.kernels.stage_keys import FEW_QUERY_ROWS

    cuda = torch.device("cuda")  # only picks the GPU tiles; nothing runs there
    missing = []
    for hq, hkv, dim, dtype in [(32, 8, 128, "bfloat16"), (14, 2, 64, "bfloat16"), (8, 8, 128, "float16"),
                                (64, 8, 128, "bfloat16"), (32, 8, 256, "bfloat16"), (16, 4, 64, "float32")]:
        dt, group = DTYPES[dtype], hq // hkv

        def params(tokens: int, keys: int, staged: bool, splits: int) -> str:
            p = extend_kernel_params(hq, hkv, HeadSplit(dim, dim, dim), dt, cuda, False, split_keys=splits > 1,
                                     keys_staged=staged, max_extend_len=tokens, max_keys=keys)
            return repr(sorted(p.items()))

        warm = {params(*v) for v in extend_variants(group, dim, dt, cuda)}
        for tokens in range(1, 4097):
            contexts = {tokens, max(tokens, SHORT_CONTEXT_KEYS), max(tokens, SHORT_CONTEXT_KEYS + 1), tokens + 4096}
            for keys in sorted(contexts):
                for staged in (False, True) if tokens * group > FEW_QUERY_ROWS else (False,):
                    for splits in (1, 2):
                        if params(tokens, keys, staged, splits) not in warm:
                            missing.append([hq, hkv, dim, dtype, tokens, keys, staged, splits])
    return {"missing": missing[:10], "num_missing": len(missing)}


def kivi_case(dtype: str, hq: int, rotary_dim: int, v_dim: int) -> dict:
    """One draft step over KIVI caches (quantized prefixes of 0, 64 and 160 tokens, then exact rows): the fused
    kernel against the torch path that dequantizes the prefix. Each query's own k/v is stored first."""
    from sglang_pic.forward_batch import BatchRows, ForwardBatch, ForwardMode
    from sglang_pic.layers.radix_attention import RadixAttention
    from sglang_pic.layers.rotary_embedding import RotaryEmbedding
    from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_pic.speculative.compress_kivi import (
        KiviCompressor, KiviDraftBackend, KiviPrefix, KiviTritonDraftBackend, quantize_layers
    )
    from sglang_pic.speculative.draft_cache import DraftBatch, DraftCache
    from sglang_pic.layers.triton_backend import TritonAttnBackend

    torch.manual_seed(7)
    hkv, dim, dt = 2, 32, DTYPES[dtype]
    prefixes, rows_per_draft = [0, 64, 160], [5, 40, 17]  # rows include the query's own slot
    pool = MHATokenToKVPool(256, 1, dt, hkv, dim, 1, "cpu", v_dim)
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    free = torch.randperm(255) + 1
    drafts, scratch, start = [], [], 0
    for n_prefix, n_rows in zip(prefixes, rows_per_draft):
        prefix = KiviPrefix(1, torch.device("cpu"))
        k, v = torch.randn(n_prefix, hkv, dim) * 2, torch.randn(n_prefix, hkv, v_dim)
        prefix.extend([quantize_layers(k[None], v[None])] if n_prefix else [])
        slots = free[start : start + n_rows]
        start += n_rows
        drafts.append(DraftCache.from_rows(slots[:-1], covered=n_prefix + n_rows - 1, pos_offset=n_prefix,
                                           prefix=prefix))
        scratch.append(slots[-1:])
    batch = DraftBatch.build(drafts, scratch, torch.device("cpu"))
    rotary = RotaryEmbedding(dim, 512, rotary_dim=rotary_dim)
    layer = RadixAttention(hq, dim, dim**-0.5, hkv, layer_id=0, rotary=rotary, v_head_dim=v_dim)
    q, k_new, v_new = torch.randn(3, hq * dim), torch.randn(3, hkv * dim), torch.randn(3, hkv * v_dim)
    outs = []
    fused = KiviCompressor().draft_backend(TritonAttnBackend(), batch, pool)
    assert isinstance(fused, KiviTritonDraftBackend)
    rows = BatchRows()
    for b, (n_prefix, n_rows) in enumerate(zip(prefixes, rows_per_draft)):
        rows.add(b, [n_prefix + n_rows - 1], [0], seq_len=n_rows)
    for backend in (fused, KiviDraftBackend(pool, batch)):
        fb = ForwardBatch.build(
            ForwardMode.DECODE, rows, torch.cat(scratch), torch.device("cpu"), req_to_token_pool=None,
            token_to_kv_pool=pool, attn_backend=backend, input_ids=torch.zeros(3, dtype=torch.int64),
        )
        backend.init_forward_metadata(fb)
        outs.append(layer(q.to(dt), k_new.to(dt), v_new.to(dt), fb).float())
    return {"dtype": dtype, "nan": bool(outs[0].isnan().any()), "vs_torch_native": relative_errors(*outs)}


def shared_decode_static_plan_case() -> dict:
    """A step's plan loaded into a CUDA graph's static plan (more item rows than live ones, a padded request)
    gives the plan's own outputs, and zeros for the padded request."""
    from sglang_pic.kernels.shared_decode import shared_decode_attention_fwd
    from sglang_pic.kernels.shared_decode_plan import StaticSharedPlan
    from sglang_pic.managers.shared_decode_planner import SharedDecodeSettings, plan_shared_decode

    lens, padded = [40, 77, 64], 4
    batch = pb.make_paged_batch([pb.decode(n) for n in lens], 4, 2, 32, torch.float32, "cpu", page_size=16)
    runs = batch.share_keys([(1, 10, 20, [(0, 0), (2, 40)])])
    settings = SharedDecodeSettings(members=2, min_chunk=8, target_items=12, max_read=1.0)
    plan = plan_shared_decode(batch.req_pool_indices.tolist(), lens, runs, settings, "cpu")
    static = StaticSharedPlan.allocate(8, settings.members, torch.device("cpu"))  # a runner's, up to 8 requests
    static.load(plan, len(lens), padded)
    q = torch.cat([batch.q, torch.randn(padded - len(lens), 4, 32)])
    out = torch.full((padded, 4, 32), float("nan"))
    shared_decode_attention_fwd(q, out, batch.kv(), static.view(padded), batch.kernel_cos_sin, batch.sm_scale)
    return {
        "dtype": "float32",
        "nan": bool(out.isnan().any()),
        "fits": static.fits(plan, padded),
        "spare_rows": static.view(padded).items.shape[0] - plan.items.shape[0],
        "vs_reference": relative_errors(out[: len(lens)], attention_reference(*batch.attention_args())),
        "padded_zero": bool((out[len(lens) :] == 0).all()),
    }


P, E, D, S = pb.prefill, pb.extend, pb.decode, pb.spans
span_specs = [S(60, [(5, 15), (30, 36)], 10), S(45, [(0, 20)], 1), P(9), S(80, [(40, 70)], 3)]
CASES: dict[str, Callable[[], dict]] = {
    "prefill_ragged_gqa_page1_fp32": lambda: attention_case([P(37), P(5), P(64), P(1)], 4, 2, 32, "float32"),
    "extend_prefix_mqa_dim16_page16_fp32": lambda: attention_case(
        [E(50, 10), E(33, 1), E(70, 70)], 4, 1, 16, "float32", page=16
    ),
    "spans_gqa_page16_fp32": lambda: attention_case(span_specs, 4, 2, 32, "float32", page=16),
    "spans_gqa_page1_bf16": lambda: attention_case(span_specs, 4, 2, 32, "bfloat16"),
    "spans_group3_page16_fp16": lambda: attention_case(span_specs, 6, 2, 32, "float16", page=16),
    "spans_partial_rotary_vdim16_fp32": lambda: attention_case(
        span_specs, 4, 2, 32, "float32", page=16, rotary_dim=16, v_head_dim=16
    ),
    "spans_baseline_rotated_keys_fp32": lambda: attention_case(
        span_specs, 4, 2, 32, "float32", page=16, keys_rotated=True
    ),
    "spans_key_splits3_fp32": lambda: attention_case(span_specs, 4, 2, 32, "float32", page=16, extend_splits=3),
    "extend_key_splits5_bf16": lambda: attention_case(
        [E(90, 4), E(33, 1), P(20)], 4, 2, 32, "bfloat16", extend_splits=5
    ),
    "spans_staged_keys_page16_fp32": lambda: attention_case(span_specs, 4, 2, 32, "float32", page=16, stage=True),
    # APE's span scaling: spans computed here and cached ones, a request with none, decodes as one-token extends,
    # requests whose spans form two groups
    "span_scaling_key_splits3_fp32": lambda: attention_case(
        [*span_specs, D(90)], 4, 2, 32, "float32", page=16, extend_splits=3,
        span_ranges=[[(5, 15), (30, 36), (40, 50)], [(0, 20)], [], [(10, 40)], [(0, 30), (60, 80)]],
        span_groups=[[0, 1, 0], [0], [], [0], [1, 0]],
    ),
    "span_scaling_staged_keys_bf16": lambda: attention_case(
        span_specs, 4, 2, 32, "bfloat16", stage=True, span_ranges=[[(5, 15), (30, 36)], [(0, 20)], [(2, 5)], []],
    ),
    # a prefill's keys all come through the store, which writes their rotated copies: no staging pass runs
    "prefill_staged_keys_fp32": lambda: attention_case([P(37), P(70)], 4, 2, 32, "float32", page=16, stage=True),
    "extend_staged_keys_splits3_partial_rotary_bf16": lambda: attention_case(
        [E(90, 40), P(33), S(50, [(8, 20)], 4)], 4, 2, 32, "bfloat16", extend_splits=3, stage=True, rotary_dim=16
    ),
    "decode_splits_gqa_page16_fp32": lambda: attention_case(
        [D(n) for n in (1, 17, 100, 250, 64)], 4, 2, 32, "float32", page=16, decode=True, splits=4
    ),
    "decode_splits_mqa_dim16_page1_bf16": lambda: attention_case(
        [D(n) for n in (130, 2, 48)], 4, 1, 16, "bfloat16", decode=True, splits=8
    ),
    "decode_group3_partial_rotary_fp16": lambda: attention_case(
        [D(n) for n in (90, 33)], 6, 2, 32, "float16", page=16, decode=True, splits=3, rotary_dim=16
    ),
    "decode_one_split_fp32": lambda: attention_case(
        [D(n) for n in (70, 5)], 4, 2, 32, "float32", decode=True, splits=1
    ),
    "decode_baseline_rotated_keys_fp32": lambda: attention_case(
        [D(n) for n in (1, 80, 200)], 4, 2, 32, "float32", page=16, decode=True, keys_rotated=True
    ),
    # fp8 pools: tiles widen as they load (decode under bf16 to fp16); the references read the same fp8 values
    "spans_staged_keys_fp8_e4m3_bf16": lambda: attention_case(
        span_specs, 4, 2, 32, "bfloat16", page=16, stage=True, kv_dtype=torch.float8_e4m3fn
    ),
    "extend_key_splits3_fp8_e5m2_fp32": lambda: attention_case(
        span_specs, 4, 2, 32, "float32", extend_splits=3, kv_dtype=torch.float8_e5m2
    ),
    "decode_splits_gqa_fp8_e4m3_bf16": lambda: attention_case(
        [D(n) for n in (40, 77, 64)], 4, 2, 32, "bfloat16", page=16, decode=True, splits=3,
        kv_dtype=torch.float8_e4m3fn,
    ),
    # (source request, first key, length, [(request, first key)]): runs shared at other offsets
    "shared_decode_gqa_page16_fp32": lambda: attention_case(
        [D(n) for n in (40, 77, 64, 23, 90)], 4, 2, 32, "float32", page=16,
        shares=[(1, 10, 20, [(0, 0), (2, 40), (4, 60)]), (4, 0, 12, [(3, 5)])],
    ),
    "shared_decode_many_members_mqa_dim16_bf16": lambda: attention_case(
        [D(n) for n in (50, 51, 60, 75, 33, 90, 41)], 4, 1, 16, "bfloat16", members=16,
        shares=[(0, 2, 30, [(1, 0), (2, 20), (3, 40), (5, 1), (6, 11)])],
    ),
    "shared_decode_gqa_fp8_e4m3_fp32": lambda: attention_case(
        [D(n) for n in (40, 77, 64, 23, 90)], 4, 2, 32, "float32", page=16, kv_dtype=torch.float8_e4m3fn,
        shares=[(1, 10, 20, [(0, 0), (2, 40), (4, 60)]), (4, 0, 12, [(3, 5)])],
    ),
    "shared_decode_group3_partial_rotary_fp16": lambda: attention_case(
        [D(n) for n in (90, 33, 61)], 6, 2, 32, "float16", rotary_dim=16,
        shares=[(0, 50, 25, [(1, 8), (2, 36)]), (2, 0, 30, [(0, 0)])],
    ),
    "store_kv_fp32": lambda: store_case("float32", rotate=False, page=16),
    "store_kv_bf16": lambda: store_case("bfloat16", rotate=False, page=1),
    "store_kv_fp8_e4m3_bf16": lambda: store_case("bfloat16", False, 16, torch.float8_e4m3fn, magnitude=300.0),
    "store_kv_fp8_e5m2_fp32": lambda: store_case("float32", False, 1, torch.float8_e5m2, magnitude=3.0),
    "store_kv_rotated_fp32": lambda: store_case("float32", rotate=True, page=16),
    "store_kv_rotated_bf16": lambda: store_case("bfloat16", rotate=True, page=1),
    "backend_extend_page16": lambda: backend_case(decode=False, page=16),
    "backend_long_prefill_page16": lambda: backend_case(decode=False, page=16, long_prefill=True),
    "backend_decode_page1": lambda: backend_case(decode=True, page=1),
    "backend_mixed_page16": lambda: backend_case(decode=False, page=16, mixed=True),
    "backend_mixed_shared_decode_page16": lambda: backend_case(decode=False, page=16, mixed=True, shared=True),
    "backend_graph_padded_extend": lambda: graph_padding_case(pb.spans(50, [(8, 20)], 4), 32),
    # 150 new tokens x 2 query heads per kv head: past FEW_QUERY_ROWS, so keys are staged
    "backend_graph_padded_staged_prefill": lambda: graph_padding_case(pb.prefill(150), 256),
    # a graph as long as the model's context, replayed by an extend with cached keys: the capture must stage them
    "backend_graph_padded_staged_extend_at_context_len": lambda: graph_padding_case(pb.extend(142, 137), 256, 256),
    "stage_decision": stage_decision_case,
    "kivi_gqa_fp32": lambda: kivi_case("float32", 4, 32, 32),
    "kivi_group3_partial_rotary_vdim16_bf16": lambda: kivi_case("bfloat16", 6, 16, 16),
    "shared_decode_static_plan": shared_decode_static_plan_case,
    "warm_up": warm_up_case,
    "warm_up_coverage": warm_up_coverage_case,
    **ENGINE_CASES,
}
