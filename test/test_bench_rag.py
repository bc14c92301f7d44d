"""The RAG benchmarks end to end on a tiny model (CPU, --quick): every mode runs and its counters add up.

No timing is compared (CPU timings here are noise); the counters are deterministic: with popular passages shared
across samples, PIC must prefill fewer tokens than prefix caching, and prefix caching no more than no cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_rag_spans  # noqa: E402
import bench_span_ttft  # noqa: E402
from rag_workload import WorkloadConfig, build_workload, rag_prompt  # noqa: E402

from sglang_pic.frontend_lang.markers import SSEP_MARKER  # noqa: E402

QUICK_SAMPLES = bench_rag_spans.PRESETS["quick"]["num_samples"]
QUICK_NEW_TOKENS = bench_rag_spans.PRESETS["quick"]["max_new_tokens"]


@pytest.fixture(scope="module")
def rag_run(tiny_llama, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench_rag")
    bench_rag_spans.main(
        ["--quick", "--model-path", str(tiny_llama), "--out", str(out), "--hf-subset", "2", "--hf-batch-sizes", "1,2",
         "--span-head-tokens", "8"]  # the quick passages are shorter than the default head
    )
    return json.loads((out / "rag_spans.json").read_text()), out


@pytest.fixture(scope="module")
def tiny_count(tiny_llama):
    from sglang_pic.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_llama))
    return lambda text: len(tok.encode(text, add_special_tokens=False))


@pytest.mark.slow  # the benchmark over every mode
def test_every_mode_serves_every_sample(rag_run):
    result, out = rag_run
    assert list(result["modes"]) == list(bench_rag_spans.MODES)
    assert (out / "rag_spans.png").stat().st_size > 0
    for name, mode in result["modes"].items():
        assert mode["samples"] == QUICK_SAMPLES, name
        assert mode["completion_tokens"] == QUICK_SAMPLES * QUICK_NEW_TOKENS, name
        assert mode["samples_per_s"] > 0, name
        assert 0 < mode["ttft_p50_s"] <= mode["ttft_p99_s"] <= mode["wall_s"], name
        assert 0 < mode["peak_token_usage"] <= 1, name
        assert mode["computed_prefill_tokens"] + mode["reused_prefill_tokens"] >= mode["prompt_tokens"], name
    assert result["modes"]["pic_barrier"]["warm_spans_s"] > 0
    assert [h["batch_size"] for h in result["hf_reference"]] == [1, 2]
    assert all(h["samples_per_s"] > 0 for h in result["hf_reference"])


@pytest.mark.slow  # the benchmark over every mode
def test_prefill_work_shrinks_with_each_cache(rag_run):
    modes = rag_run[0]["modes"]
    none, prefix, barrier, isps = (modes[m] for m in bench_rag_spans.MODES)
    assert none["reused_prefill_tokens"] == 0
    assert none["computed_prefill_tokens"] == none["prompt_tokens"]
    assert none["cache_kv_tokens"] == 0
    assert prefix["computed_prefill_tokens"] <= none["computed_prefill_tokens"]
    assert isps["computed_prefill_tokens"] < prefix["computed_prefill_tokens"]
    assert barrier["computed_prefill_tokens"] < prefix["computed_prefill_tokens"]
    assert isps["cached_span_tokens"] > 0 and barrier["cached_span_tokens"] > 0
    assert prefix["cached_span_tokens"] == 0


def test_workload_is_deterministic_and_skewed(tiny_count):
    cfg = WorkloadConfig(num_samples=40, num_passages=4, corpus_size=30, passage_tokens=(30, 60), zipf=1.2, seed=3)
    first, again = build_workload(cfg, tiny_count), build_workload(cfg, tiny_count)
    assert first == again
    assert build_workload(WorkloadConfig(**{**cfg.__dict__, "seed": 4}), tiny_count).samples != first.samples
    for p in first.corpus:
        assert p.num_tokens == tiny_count(p.text) and 30 <= p.num_tokens <= 60
        assert p.title in p.text
    uses = [pid for s in first.samples for pid in s.passage_ids]
    assert all(len(set(s.passage_ids)) == 4 for s in first.samples)
    assert max(uses.count(pid) for pid in set(uses)) > 2 * len(uses) / len(first.corpus)  # popular passages recur
    sample = first.samples[0]
    prompt = first.prompt(sample)
    assert prompt.count(SSEP_MARKER) == 4 and sample.question in prompt
    assert SSEP_MARKER not in first.plain_prompt(sample)


def test_long_passages_honor_the_range(tiny_count):
    """Issue 54: passages stopped where their dozen facts ran out (about 250 tokens) whatever range was asked for."""
    cfg = WorkloadConfig(num_samples=4, num_passages=3, corpus_size=6, passage_tokens=(1000, 4000))
    work = build_workload(cfg, tiny_count)
    assert {p.kind for p in work.corpus} == {"town", "person", "film"}
    for p in work.corpus:
        assert 1000 <= p.num_tokens <= 4000 and p.num_tokens == tiny_count(p.text), p.title
        assert p.text.startswith(f"{p.title}\n")
    summary = work.summary()
    assert summary["passage_tokens_requested"] == [1000, 4000]
    assert 1000 <= summary["passage_tokens_min"] <= summary["passage_tokens_max"] <= 4000
    assert "requested 1000,4000" in work.describe()


@pytest.mark.parametrize(
    "passage_tokens, message",
    [((3, 3), r"passage_tokens 3,3: .* needs \d+ tokens for its title line and one word"),
     ((400, 100), r"passage_tokens 400,100: need 1 <= min <= max"),
     ((0, 10), r"passage_tokens 0,10: need 1 <= min <= max")],
)
def test_unhonorable_passage_ranges_are_refused(tiny_count, passage_tokens, message):
    with pytest.raises(ValueError, match=message):
        build_workload(WorkloadConfig(num_samples=2, num_passages=2, corpus_size=4, passage_tokens=passage_tokens),
                       tiny_count)


@pytest.mark.parametrize(
    "flags, message",
    [(["--passage-tokens", "800"], "--passage-tokens takes MIN,MAX, got '800'"),
     (["--passage-tokens", "2000,800"], "passage_tokens 2000,800: need 1 <= min <= max"),
     (["--num-passages", "12", "--corpus-size", "10"], "num_passages 12: need 1 <= num_passages <= corpus_size"),
     (["--quantization", "fp8", "--hf-subset", "4"], "--quantization needs --hf-subset 0")],
)
def test_the_benchmark_refuses_impossible_sizes(capsys, flags, message):
    with pytest.raises(SystemExit):
        bench_rag_spans.parse_args(flags)
    assert message in capsys.readouterr().err


def test_quantization_reaches_the_engine():
    args = bench_rag_spans.parse_args(["--quantization", "fp8", "--hf-subset", "0"])
    assert bench_rag_spans.engine_kwargs(args, "m", "t")["quantization"] == "fp8"
    assert "quantization" not in bench_rag_spans.engine_kwargs(bench_rag_spans.parse_args([]), "m", "t")


def test_sglang_program_renders_the_plain_prompt():
    pytest.importorskip("sglang")
    from rag_workload import rag_program
    from sglang.lang.backend.base_backend import BaseBackend
    from sglang.lang.chat_template import get_chat_template

    class Echo(BaseBackend):
        """A backend that answers every gen with a fixed string, so the program's text can be read back."""

        def __init__(self) -> None:
            super().__init__()
            self.chat_template = get_chat_template("chatml")

        def generate(self, s, sampling_params):
            return "ANSWER", {}

    passages = ["Alpha\nThe first passage.\n", "Beta\nThe second passage.\n"]
    state = rag_program.run(system="Be brief.", passages=passages, question="Which is first?", backend=Echo())
    assert state["answer"] == "ANSWER"
    assert state.text() == rag_prompt("Be brief.", passages, "Which is first?") + "ANSWER<|im_end|>\n"


def test_span_ttft_reuses_the_span_at_a_new_offset(tiny_llama, tmp_path):
    result = bench_span_ttft.main(["--quick", "--model-path", str(tiny_llama), "--out", str(tmp_path),
                                   "--span-lengths", "24,48", "--span-head-tokens", "0"])
    lengths = result["lengths"]
    assert [r["span_tokens"] for r in lengths] == [24, 48]
    for r in lengths:
        assert r["cached_span_tokens"] == r["span_tokens"]
        assert r["cold_ttft_s"] > 0 and r["cached_ttft_s"] > 0
    assert (tmp_path / "span_ttft.png").stat().st_size > 0


def test_poisson_arrivals_serve_every_sample(tiny_llama, tmp_path):
    """With --arrival-rate the samples trickle in; the barrier mode warms each sample's spans before its prompt."""
    bench_rag_spans.main(
        ["--quick", "--model-path", str(tiny_llama), "--out", str(tmp_path), "--hf-subset", "0",
         "--modes", "prefix_cache,pic_barrier,pic_isps", "--arrival-rate", "40", "--span-head-tokens", "8"]
    )
    result = json.loads((tmp_path / "rag_spans.json").read_text())
    for name, mode in result["modes"].items():
        assert mode["samples"] == QUICK_SAMPLES, name
        assert mode["completion_tokens"] == QUICK_SAMPLES * QUICK_NEW_TOKENS, name
        assert 0 < mode["ttft_p50_s"] <= mode["ttft_p99_s"] <= mode["wall_s"], name
    lo, hi = (int(b) for b in bench_rag_spans.PRESETS["quick"]["passage_tokens"].split(","))
    workload = result["workload"]  # the lengths the run really used, next to the ones asked for
    assert workload["passage_tokens_requested"] == [lo, hi]
    assert lo <= workload["passage_tokens_min"] <= workload["passage_tokens_max"] <= hi
    barrier, isps = result["modes"]["pic_barrier"], result["modes"]["pic_isps"]
    # Every prompt of the barrier mode found all of its spans cached; ISPS reused spans too.
    assert barrier["cached_span_tokens"] > 0 and isps["cached_span_tokens"] > 0
    assert barrier["computed_prefill_tokens"] < result["modes"]["prefix_cache"]["computed_prefill_tokens"]


@pytest.mark.slow  # the benchmark over every mode
def test_repeats_interleave_modes_and_report_the_median_run(tiny_llama, tmp_path):
    modes = ["pic_barrier", "pic_isps"]
    bench_rag_spans.main(["--quick", "--model-path", str(tiny_llama), "--out", str(tmp_path), "--hf-subset", "0",
                          "--modes", ",".join(modes), "--repeats", "3"])
    result = json.loads((tmp_path / "rag_spans.json").read_text())
    runs = result["samples_per_s_runs"]
    assert list(runs) == modes and all(len(rates) == 3 for rates in runs.values())
    for mode in modes:
        assert result["modes"][mode]["samples_per_s"] == sorted(runs[mode])[1]
