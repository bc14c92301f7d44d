"""VeriCache speculative decoding: lossless against full-KV decoding, exact memory accounting, compressor contracts.

One file (over 400 lines): every case shares the engine builders and the hard compression settings.

Every engine here compresses hard (a 24-token draft budget on prompts of up to ~110 tokens, so drafts are wrong
often and rejection paths run), yet greedy output must equal plain decoding token for token and sampled output
must follow the same distribution.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from scipy.stats import chi2_contingency
from sglang_pic import Engine
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.metrics import ServerMetrics
from sglang_pic.managers.output_format import output_of
from sglang_pic.managers.req import Req
from sglang_pic.managers.scheduler_process import scheduler_snapshot
from sglang_pic.speculative import spec_sampling
from sglang_pic.speculative.compress_kivi import (
    GROUP,
    KiviCompressor,
    KiviPrefix,
    dequantize_keys,
    dequantize_values,
    pack,
    prefix_bytes_per_token,
    quantize_keys,
    quantize_layers,
    quantize_values,
    unpack,
)
from sglang_pic.speculative.compress_streaming import NUM_SINKS
from sglang_pic.speculative.compressor_base import create_compressor, resolve_budget
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool
from sglang_pic.server_args import ServerArgs
from sglang_pic.speculative.host_kv_tier import HostKVTier, staging_depth
from test_engine import assert_idle_accounting
from tiny_models import build_tiny_model

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little town by the sea where fishermen told stories every night. " * 2,
    "def add(a, b): return a + b  # a tiny Python function that adds two numbers together " * 4,
]
NEW_TOKENS = 48
BUDGET = 24
COMPRESSORS = ["streaming", "snapkv", "h2o", "kivi"]


def greedy(n: int = NEW_TOKENS) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def engine(path, **kwargs) -> Engine:
    args = dict(model_path=str(path), dtype="float32", max_total_tokens=4096)
    args.update(kwargs)
    return Engine(**args)


def vericache(path, compressor="streaming", k=8, full_kv="gpu", budget=BUDGET, **kwargs) -> Engine:
    return engine(
        path, speculative_algorithm="vericache", speculative_num_draft_tokens=k, vericache_compressor=compressor,
        vericache_budget=budget, vericache_full_kv=full_kv, **kwargs,
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run many small ops: one thread avoids OpenMP spin-waits when the CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def references(tiny_llama, tiny_qwen2) -> dict:
    out = {}
    for name, path in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        with engine(path) as e:
            out[name] = (path, [o["output_ids"] for o in e.generate(PROMPTS, greedy())])
    return out


# ---- lossless greedy ----------------------------------------------------------------------------------------


def _model_of(compressor: str, k: int, full_kv: str) -> str:
    """Each compressor, k and full-KV place runs on both models, over the 24 combinations of those three."""
    c, j, f = COMPRESSORS.index(compressor), [1, 8, 32].index(k), ["gpu", "host"].index(full_kv)
    return ["llama", "qwen2"][(c + j + f) % 2]


def _pairwise_fast(compressor: str, k: int, full_kv: str) -> tuple:
    """The fast lane keeps 12 of the 24 combinations, every pair of values among them (model included)."""
    c, j = COMPRESSORS.index(compressor), [1, 8, 32].index(k)
    return () if full_kv == ["gpu", "host"][(c // 2 + j // 2) % 2] else (pytest.mark.slow,)


@pytest.mark.parametrize(
    "model,compressor,k,full_kv",
    [
        pytest.param(_model_of(c, k, f), c, k, f, marks=_pairwise_fast(c, k, f))
        for f in ("gpu", "host") for k in (1, 8, 32) for c in COMPRESSORS
    ],
)
def test_greedy_identical_to_full_kv(references, model, compressor, k, full_kv):
    path, expected = references[model]
    with vericache(path, compressor, k, full_kv, page_size=4 if k == 8 else 1) as e:
        outs = e.generate(PROMPTS, greedy())
        assert [o["output_ids"] for o in outs] == expected
        stats = e.scheduler.spec_worker.stats
        assert 0 < stats.accepted_drafts < stats.draft_tokens  # drafts were both right and wrong
        assert stats.draft_builds > len(PROMPTS)  # drafts were compressed again while decoding
        assert (stats.h2d_bytes > 0) == (full_kv == "host")
        assert_idle_accounting(e)


def test_penalised_greedy_identical_to_full_kv(tiny_llama):
    """Penalties look at drafted tokens before they are committed (PenaltyCounts' extras): drafting and
    verification must see the same history as plain decoding, or the output would differ."""
    params = [
        {**greedy(), "repetition_penalty": 1.6},
        {**greedy(), "frequency_penalty": 1.5, "presence_penalty": 0.5},
        greedy(),
    ]
    with engine(tiny_llama) as e:
        expected = [o["output_ids"] for o in e.generate(PROMPTS, params)]
    with engine(tiny_llama) as e:
        assert [o["output_ids"] for o in e.generate(PROMPTS, [greedy()] * 3)][:2] != expected[:2]
    with vericache(tiny_llama, "snapkv", 8) as e:
        assert [o["output_ids"] for o in e.generate(PROMPTS, params)] == expected
        stats = e.scheduler.spec_worker.stats
        assert 0 < stats.accepted_drafts < stats.draft_tokens
        assert_idle_accounting(e)


@pytest.mark.parametrize("full_kv", ["gpu", "host"])
@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_uncompressed_draft_is_always_accepted(references, compressor, full_kv):
    """With a budget above the context nothing is dropped or quantized: drafting is then plain decoding."""
    path, expected = references["llama"]
    with vericache(path, compressor, 8, full_kv, budget=10_000) as e:
        assert [o["output_ids"] for o in e.generate(PROMPTS, greedy())] == expected
        stats = e.scheduler.spec_worker.stats
        assert stats.accepted_drafts == stats.draft_tokens > 0


@pytest.mark.parametrize(
    "compressor,full_kv,groups",
    [
        # the fast lane keeps the 4 of the 8 that hold every pair of values
        pytest.param(c, f, g, marks=() if (i + j + g) % 2 == 0 else pytest.mark.slow, id=f"{c}-{f}-{g}")
        for g in (2, 3) for j, f in enumerate(("gpu", "host")) for i, c in enumerate(("snapkv", "kivi"))
    ],
)
def test_staggered_rounds_are_lossless(references, compressor, full_kv, groups):
    """Requests drafted and verified group by group (each still once per round) keep full-KV decoding's tokens."""
    path, expected = references["llama"]
    with vericache(path, compressor, 8, full_kv, vericache_stagger_groups=groups) as e:
        outs = e.generate(PROMPTS, greedy())
        assert [o["output_ids"] for o in outs] == expected
        stats = e.scheduler.spec_worker.stats
        assert stats.verify_batches >= stats.rounds + 1  # rounds with several requests verified them in groups
        assert 0 < stats.accepted_drafts < stats.draft_tokens
        assert_idle_accounting(e)


def test_staggered_round_order_overlaps_transfers_with_drafting(references, monkeypatch):
    """A group's verification is set up (host copies start) before it drafts, and verified only after the next
    group's setup and drafts, so every transfer has drafting queued beside it."""
    path, expected = references["llama"]
    with vericache(path, "kivi", 8, "host", vericache_stagger_groups=2) as e:
        worker = e.scheduler.spec_worker
        calls: list[tuple[str, tuple[str, ...]]] = []

        def record(name, fn):
            def wrapped(reqs, *args):
                calls.append((name, tuple(r.rid for r in reqs)))
                return fn(reqs, *args)

            monkeypatch.setattr(worker, name, wrapped)

        for name in ("_draft", "_prepare_verify", "_verify_and_accept"):
            record(name, getattr(worker, name))
        assert [o["output_ids"] for o in e.generate(PROMPTS, greedy())] == expected
    first_round = calls[:6]
    a, b = first_round[0][1], first_round[2][1]
    assert first_round == [
        ("_prepare_verify", a), ("_draft", a), ("_prepare_verify", b), ("_draft", b),
        ("_verify_and_accept", a), ("_verify_and_accept", b),
    ]
    assert a and b and not set(a) & set(b)


def test_host_tier_reuses_freed_buffers():
    """Freed buffers serve the next requests that fit them (the smallest that fits), since pinning is slow; the
    bytes in use count only live requests."""
    tier = HostKVTier(MHATokenToKVPool(64, 1, torch.float32, 2, 4, 3, "cpu"), torch.device("cpu"))
    small, large = tier.alloc(10), tier.alloc(40)
    ptrs = {10: small.k.data_ptr(), 40: large.k.data_ptr()}
    tier.free(large)
    tier.free(small)
    assert tier.bytes_in_use == 0
    again = tier.alloc(8)
    assert again.k.data_ptr() == ptrs[10] and again.capacity == 10
    assert tier.alloc(20).k.data_ptr() == ptrs[40]
    assert tier.alloc(5).k.data_ptr() not in ptrs.values()  # none left
    assert tier.bytes_in_use == (10 + 40 + 5) * tier.token_bytes()


def watch_streaming_backends(e: Engine, see) -> None:
    """Call see(backend) with each host-streaming backend the engine's VeriCache worker makes."""
    full_kv = e.scheduler.spec_worker.full_kv
    make = full_kv.wrap

    def wrap(reqs, inner):
        backend = make(reqs, inner)
        see(backend)
        return backend

    full_kv.wrap = wrap


def test_host_tier_with_two_staged_layers_is_lossless(tmp_path):
    """A staging budget below one layer leaves a ring of two buffers that the copies of 4 layers reuse in turn."""
    path = str(build_tiny_model(tmp_path, "llama", num_hidden_layers=4))
    with engine(path) as e:
        expected = [o["output_ids"] for o in e.generate(PROMPTS, greedy())]
    with vericache(path, "snapkv", 8, "host", vericache_staging_gb=1e-9) as e:
        backends = []
        watch_streaming_backends(e, backends.append)
        assert [o["output_ids"] for o in e.generate(PROMPTS, greedy())] == expected
        assert backends and {b.depth for b in backends} == {2}
        assert_idle_accounting(e)
    with pytest.raises(ValueError, match="vericache_staging_gb"):
        ServerArgs(model_path=path, vericache_staging_gb=0)


def test_host_streaming_backends_are_freed_without_the_cycle_collector(references):
    """A verification's staging buffers (GBs on a GPU) go when it ends, not whenever Python's cycle collector next
    runs: nothing in a host-streaming backend may refer back to it."""
    path, expected = references["llama"]
    with vericache(path, "snapkv", 8, "host") as e:
        alive: weakref.WeakSet = weakref.WeakSet()
        created = []

        def see(backend) -> None:
            alive.add(backend)
            created.append(1)

        watch_streaming_backends(e, see)
        gc.collect()
        gc.disable()
        try:
            assert [o["output_ids"] for o in e.generate(PROMPTS, greedy())] == expected
            assert len(created) > 2 and len(alive) == 0
        finally:
            gc.enable()


def test_staging_depth_fills_its_budget_within_the_layers():
    budget = 4 * 2**30
    assert staging_depth(100, 1000, 24, budget) == 24  # small contexts: every layer staged before the forward starts
    assert staging_depth(10**9, 1000, 24, budget) == 2  # huge ones: still double-buffered
    assert staging_depth(budget // 5000, 1000, 24, budget) == 5


def test_prefix_cache_and_chunked_prefill(references):
    """Requests reuse cached prefixes; prompts prefill in 16-token chunks between rounds (ISPS, which would
    otherwise mix decodes into prefill steps)."""
    path, expected = references["qwen2"]
    with vericache(path, "snapkv", 8, chunked_prefill_size=16, schedule_policy="isps") as e:
        first = e.generate(PROMPTS, greedy())
        again = e.generate(PROMPTS[1:], greedy())
        assert [o["output_ids"] for o in first] == expected
        assert [o["output_ids"] for o in again] == expected[1:]
        assert again[0]["meta_info"]["cached_tokens"] > 0
        assert_idle_accounting(e)


def test_logprobs_and_per_request_stats(references):
    path, expected = references["llama"]
    with engine(path) as plain:
        ref = plain.generate(PROMPTS[1], greedy(), return_logprob=True, top_logprobs_num=2, token_ids_logprob=[4, 9])
    with vericache(path, "kivi", 8) as e:
        sched = e.scheduler
        obj = GenerateReqInput(text=PROMPTS[1], sampling_params=greedy(), return_logprob=True, top_logprobs_num=2,
                               token_ids_logprob=[4, 9])
        (msg,) = e.request_builder.build(obj)
        req = Req.from_wire(msg)
        sched.add_request(req)
        while not req.finished():
            sched.step()
        out = output_of(e.formatter, msg, req)
        assert out["output_ids"] == expected[1]
        got = out["meta_info"]["output_token_logprobs"]
        want = ref["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert torch.allclose(torch.tensor([x[0] for x in got]), torch.tensor([x[0] for x in want]), atol=1e-4)
        assert len(out["meta_info"]["output_top_logprobs"]) == NEW_TOKENS
        got = [row for rows in out["meta_info"]["output_token_ids_logprobs"] for row in rows]
        want = [row for rows in ref["meta_info"]["output_token_ids_logprobs"] for row in rows]
        assert [t for _, t, _ in got] == [4, 9] * NEW_TOKENS == [t for _, t, _ in want]
        assert [v for v, _, _ in got] == pytest.approx([v for v, _, _ in want], abs=1e-4)
        meta = req.spec_stats.to_meta()
        # The first token comes from prefill; every later one from a round.
        assert req.spec_stats.committed_tokens == NEW_TOKENS - 1
        assert meta["spec_verify_ct"] == req.spec_stats.verify_ct and meta["spec_accept_length"] >= 1.0
        engine_stats = sched.spec_worker.stats.to_dict()
        assert engine_stats["committed_tokens"] == NEW_TOKENS - 1
        assert engine_stats["draft_time_s"] > 0 and engine_stats["verify_time_s"] > 0


def test_statistics_in_metrics(references):
    """/metrics reports engine-wide acceptance, time split and host bytes (and none of it without speculation)."""
    path, _ = references["llama"]

    def scrape(e) -> dict[str, float]:
        text = ServerMetrics("m").render(scheduler_snapshot(e.scheduler, e.runner.allocator)).decode()
        lines = [line for line in text.splitlines() if line.startswith("sglang:spec")]
        return {line.split("{")[0]: float(line.split()[-1]) for line in lines}

    with engine(path) as plain:
        plain.generate(PROMPTS[0], greedy())
        assert scrape(plain) == {}
    with vericache(path, "snapkv", 8, "host") as e:
        e.generate(PROMPTS, greedy())
        stats = e.scheduler.spec_worker.stats.to_dict()
        got = scrape(e)
    assert got["sglang:spec_accept_length"] == pytest.approx(stats["accept_length"]) and stats["accept_length"] > 1
    assert got["sglang:spec_accept_rate"] == pytest.approx(stats["accept_rate"])
    assert got["sglang:spec_verify_ct_total"] == stats["verify_ct"]
    assert got["sglang:spec_draft_tokens_total"] == stats["draft_tokens"]
    assert got["sglang:spec_accepted_tokens_total"] == stats["accepted_drafts"]
    assert got["sglang:spec_draft_seconds_total"] == pytest.approx(stats["draft_time_s"]) and stats["draft_time_s"] > 0
    assert got["sglang:spec_verify_seconds_total"] == pytest.approx(stats["verify_time_s"])
    assert stats["verify_time_s"] > 0
    assert got["sglang:spec_host_to_device_bytes_total"] == stats["h2d_bytes"] > 0


# ---- memory accounting --------------------------------------------------------------------------------------


@pytest.mark.parametrize("full_kv", ["gpu", "host"])
def test_abort_mid_round_frees_everything(tiny_llama, full_kv):
    with vericache(tiny_llama, "kivi", 8, full_kv, page_size=4) as e:
        stream = e.generate(PROMPTS[2], greedy(60), stream=True)
        chunks = [next(stream) for _ in range(3)]
        assert chunks[-1]["meta_info"]["completion_tokens"] >= 3
        stream.close()
        assert not e.scheduler.spec_worker.drafts
        assert_idle_accounting(e)


@pytest.mark.parametrize("full_kv", ["gpu", "host"])
def test_retraction_under_small_pool(tiny_qwen2, full_kv):
    prompts = [f"{p} number {i}" for i, p in enumerate(PROMPTS[:2] * 4)]
    with engine(tiny_qwen2) as big:
        expected = [o["output_ids"] for o in big.generate(prompts, greedy(40))]
    with vericache(
        tiny_qwen2, "h2o", 8, full_kv, max_total_tokens=320, page_size=4, chunked_prefill_size=64
    ) as small:
        outs = small.generate(prompts, greedy(40))
        assert [o["output_ids"] for o in outs] == expected
        assert small.scheduler.stats.num_retractions > 0
        assert not small.scheduler.spec_worker.drafts
        assert_idle_accounting(small)
        if full_kv == "host":
            assert small.scheduler.spec_worker.full_kv.tier.bytes_in_use == 0


# ---- sampling -----------------------------------------------------------------------------------------------

SAMPLES = 600


def _pairs(e: Engine, seed: int) -> list[tuple[int, int]]:
    params = [
        {"temperature": 1.0, "top_k": 4, "max_new_tokens": 3, "ignore_eos": True, "seed": seed + i}
        for i in range(SAMPLES)
    ]
    outs = e.generate([PROMPTS[1]] * SAMPLES, params)
    return [tuple(o["output_ids"][1:3]) for o in outs]


def _chi2_pvalue(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> float:
    cells = sorted(set(a) | set(b))
    table = [[a.count(c) for c in cells], [b.count(c) for c in cells]]
    keep = [i for i in range(len(cells)) if table[0][i] + table[1][i] >= 10]  # pool rare cells
    rare = [[row[i] for i in range(len(cells)) if i not in keep] for row in table]
    rows = [[row[i] for i in keep] + [sum(r)] for row, r in zip(table, rare)]
    return chi2_contingency(rows)[1]


@pytest.fixture(scope="module")
def full_kv_samples(tiny_llama) -> list[tuple[int, int]]:
    with engine(tiny_llama) as e:
        return _pairs(e, 0)


def test_sampled_distribution_matches_full_kv(tiny_llama, full_kv_samples):
    with vericache(tiny_llama, "streaming", 2, budget=4) as e:
        spec = _pairs(e, 10_000)
        stats = e.scheduler.spec_worker.stats
        assert 0 < stats.accepted_drafts < stats.draft_tokens  # q differs from p, so rejection sampling mattered
    assert _chi2_pvalue(full_kv_samples, spec) > 0.001


def test_chi_square_catches_blind_acceptance(tiny_llama, full_kv_samples, monkeypatch):
    """The check above has power: accepting every draft outputs the draft distribution, which it rejects."""

    def accept_all(drafts, q, p, generator):
        return len(drafts), spec_sampling.draw(p[len(drafts)], generator)

    from sglang_pic.speculative import vericache_worker

    monkeypatch.setattr(vericache_worker, "accept_sampled", accept_all)
    with vericache(tiny_llama, "streaming", 2, budget=4) as e:
        biased = _pairs(e, 20_000)
    assert _chi2_pvalue(full_kv_samples, biased) < 0.001


# ---- compressor contracts -----------------------------------------------------------------------------------


def test_kivi_quantization_error_within_bound():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4 * GROUP, 3, 16, generator=gen)
    x[:, :, 5] *= 20  # an outlier channel: per-channel key scales keep it from hurting the others
    keys = quantize_keys(x)
    assert keys.codes.dtype == torch.uint8 and keys.codes.shape == (4 * GROUP, 3, 4)  # 2 bits per value
    err = (dequantize_keys(keys) - x).abs()
    bound = keys.scale.repeat_interleave(GROUP, dim=0) / 2  # round-to-nearest: half a step
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    values = quantize_values(x)
    err = (dequantize_values(values) - x).abs()
    bound = values.scale.repeat_interleave(16 // values.scale.shape[-1], dim=-1) / 2
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    codes = torch.randint(0, 4, (5, 8), dtype=torch.uint8, generator=gen)
    assert torch.equal(unpack(pack(codes)), codes)


@pytest.mark.parametrize("head_dim,v_head_dim", [(64, 64), (128, 128), (32, 16)])
def test_prefix_bytes_per_token_is_what_the_prefix_holds(head_dim, v_head_dim):
    """The pool leaves room for KIVI's prefixes by this count: it must equal the bytes the stored parts take."""
    layers, heads, tokens = 3, 2, 4 * GROUP
    prefix = KiviPrefix(layers, torch.device("cpu"))
    prefix.extend([quantize_layers(torch.randn(layers, tokens, heads, head_dim),
                                   torch.randn(layers, tokens, heads, v_head_dim))])
    stored = sum(x.nbytes for q in (prefix.keys, prefix.values) for x in (q.codes, q.scale, q.zero))
    assert stored == tokens * prefix_bytes_per_token(layers, heads, head_dim, v_head_dim)


@pytest.mark.parametrize("compressor", ["streaming", "snapkv", "h2o"])
@pytest.mark.parametrize("n,budget", [(200, 24), (200, 1), (200, 199), (10, 24), (50, 50)])
def test_selectors_keep_exactly_their_budget(compressor, n, budget):
    comp = create_compressor(compressor)
    state = comp.new_state()
    scores = torch.rand(2, 3, n, generator=torch.Generator().manual_seed(n))
    index = comp.select(n, budget, scores, state)
    keep = min(budget, n)
    assert index.shape[-1] == keep and index.shape[0] in (1, 2)
    for row in index:
        assert torch.equal(row, torch.unique(row)) and 0 <= int(row.min()) and int(row.max()) < n
        if budget >= 2 and n > budget:
            assert int(row[-1]) == n - 1  # the newest token is always kept
    if compressor == "streaming" and n > budget:
        sinks = min(NUM_SINKS, budget // 2)
        assert index[0, :sinks].tolist() == list(range(sinks))


class _FakeSource:
    def __init__(self, n: int) -> None:
        self.num_tokens, self.num_layers = n, 2
        self.k = torch.randn(2, n, 2, 16)

    def rows_for(self, index):
        return index + 1000

    def read(self, layer, index):
        return self.k[layer, index], self.k[layer, index] * 2


@pytest.mark.parametrize("n,budget", [(200, 24), (200, 32), (20, 24), (100, 1)])
def test_kivi_keeps_budget_exact_tokens(n, budget):
    draft = KiviCompressor().build(_FakeSource(n), budget, None, None, torch.device("cpu"))
    quantized = draft.prefix.length
    assert quantized % GROUP == 0 and quantized == draft.pos_offset
    assert quantized + draft.length == n
    assert draft.length == n if n <= budget else budget <= draft.length < budget + GROUP


def test_budget_resolution_and_bad_config(tiny_llama):
    assert resolve_budget(0.25, 100) == 25 and resolve_budget(0.001, 100) == 1 and resolve_budget(64, 10) == 64
    with pytest.raises(ValueError, match="mixed_chunk"):
        vericache(tiny_llama, full_kv="host", enable_mixed_chunk=True)
    with pytest.raises(ValueError, match="vericache_compressor"):
        vericache(tiny_llama, compressor="nope")
    with pytest.raises(ValueError, match="vericache_full_kv"):
        vericache(tiny_llama, full_kv="disk")
    with pytest.raises(ValueError, match="vericache_stagger_groups"):
        vericache(tiny_llama, vericache_stagger_groups=0)


SPAN_DOCS = [
    "The harbour master logs every ship that enters the bay, with its cargo and its flag, in a green book.",
    "In the old mill by the river the miller grinds barley on Mondays and wheat on every other weekday.",
]


@pytest.mark.parametrize("full_kv", ["gpu", "host"])
def test_spans_from_jobs_are_lossless(tiny_llama, full_kv):
    """Anchored spans with recomputed seams (span_policy.py): the drafts and the verification read the same rows
    as plain decoding, whose greedy tokens they keep."""
    from sglang_pic.frontend_lang.markers import span

    prompts = [f"Reader {i} asks." + span(SPAN_DOCS[i % 2]) + span(SPAN_DOCS[1 - i % 2]) + " Answer:" for i in range(3)]
    settings = dict(span_anchor="auto", span_head_tokens=2, span_tail_tokens=2)
    with engine(tiny_llama, **settings) as e:
        expected = [o["output_ids"] for o in e.generate(prompts, greedy())]
    with vericache(tiny_llama, "snapkv", 8, full_kv, **settings) as e:
        first = e.generate(prompts[0], greedy())
        rest = e.generate(prompts[1:], greedy())
        assert [o["output_ids"] for o in [first, *rest]] == expected
        assert all(o["meta_info"]["cached_span_tokens"] > 0 and o["meta_info"]["recomputed_span_tokens"] == 8
                   for o in rest)
        assert_idle_accounting(e)
