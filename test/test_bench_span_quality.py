"""The span-quality benchmark end to end on a tiny model: every task x mode is reported with every field, a mode
equal to dense agrees with dense exactly, seams recompute a share of the span tokens that isolated spans do not,
and dense and span prompts are the same token ids.

A random tiny model answers nothing right, so accuracies are only checked to be fractions; what is deterministic
is the comparison machinery (agreement, KL, prefill counts) and the prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_span_quality as bench  # noqa: E402
from span_quality_tasks import TASKS, BenchTaskSizes  # noqa: E402

from sglang_pic.entrypoints.tool_calls import ToolCall  # noqa: E402
from sglang_pic.frontend_lang.markers import SSEP_MARKER, strip_markers  # noqa: E402
from sglang_pic.span_quality.items import Gold, ToolGold  # noqa: E402
from sglang_pic.span_quality.judging import judge  # noqa: E402
from sglang_pic.span_quality.modes import MODES as ALL_MODES  # noqa: E402
from sglang_pic.span_quality.modes import Mode, span_mode, span_mode_name  # noqa: E402
from sglang_pic.span_quality.prompts import PromptBuilder, Workload  # noqa: E402
from sglang_pic.span_quality.sizes import TaskSizes  # noqa: E402

# The Hermes layout Qwen2.5's template uses: one JSON line per tool inside <tools>, then the system message.
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'system' and tools %}\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SIZES = ["--qa-docs", "3", "--qa-pool", "5", "--rag-passages", "3", "--rag-corpus", "8", "--rag-passage-tokens",
         "24,40", "--num-tools", "3", "--needle-spans", "3", "--needle-pool", "4", "--depth-buckets", "2",
         "--records-docs", "3", "--records-pool", "4", "--code-functions", "2", "--long-docs", "2", "--long-pool", "3",
         "--long-tokens", "160,320"]
MODES = ["dense", "naive", "dense_again", "anchor+seams8"]
DEPTH_TASKS = ("needle", "long_spans")  # their items record the fact's depth


def qwen2_with_tools(tiny_model_root: Path) -> tuple[Path, Path]:
    """A tiny Qwen2 whose context holds the tasks' prompts, and a chat template that renders tools; built once per
    session (check_span_quality's tests use them too)."""
    from tiny_models import build_tiny_model

    model = tiny_model_root / "qwen2_4k"
    if not (model / "config.json").is_file():
        build_tiny_model(tiny_model_root, "qwen2", name="qwen2_4k", max_position_embeddings=4096)
    template = tiny_model_root / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    return model, template


@pytest.fixture(scope="module")
def setup(tiny_model_root, tmp_path_factory) -> tuple[Path, Path, Path]:
    model, template = qwen2_with_tools(tiny_model_root)
    return model, template, tmp_path_factory.mktemp("span_quality") / "out" / "span_quality_cpu.json"


@pytest.fixture(scope="module")
def run(setup) -> dict:
    model, template, output = setup
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench.MODES, "dense_again", Mode("dense"))  # a mode that must equal dense
        bench.main(["--model-path", str(model), "--chat-template", str(template), "--samples", "3",
                    "--batch-size", "2", "--modes", ",".join(MODES), "--output", str(output), "--split", "tuning",
                    *SIZES])
    return json.loads(output.read_text())


@pytest.mark.slow  # the benchmark's run over every task and mode
def test_every_task_and_mode_is_reported(run, setup):
    assert setup[2].with_suffix(".png").stat().st_size > 0
    assert list(run["results"]) == list(TASKS)
    assert list(run["modes"]) == MODES
    assert run["config"]["split"] == "tuning"
    for task, by_mode in run["results"].items():
        assert list(by_mode) == MODES, task
        for mode, r in by_mode.items():
            assert r["samples"] == 3, (task, mode)
            assert 0 <= r["accuracy"] <= 1, (task, mode)
            for key in ("agreement_with_dense", "first_token_top1_agreement", "first_token_kl",
                        "extra_prefill_tokens_per_request"):
                assert r[key] is not None, (task, mode, key)
            assert 0 < r["computed_prefill_tokens_per_request"] <= r["prompt_tokens_per_request"], (task, mode)
            assert 0 < r["span_tokens_per_request"] < r["prompt_tokens_per_request"], (task, mode)
            assert 0 <= r["recomputed_span_share"] <= 1, (task, mode)
            assert r["wall_s"] > 0 and len(r["examples"]) == 3, (task, mode)
            assert (r["accuracy_by_depth"] is not None) == (task in DEPTH_TASKS), (task, mode)
        assert 0 < run["tasks"][task]["reference_topk_mass"] <= 1 + 1e-6, task
    for mode in MODES:
        assert run["modes"][mode]["wall_s"] > 0 and run["modes"][mode]["computed_prefill_tokens"] > 0
        mean = run["mean_over_tasks"][mode]
        assert mean["accuracy"] == pytest.approx(sum(run["results"][t][mode]["accuracy"] for t in TASKS) / len(TASKS))


@pytest.mark.slow  # the benchmark's run over every task and mode
def test_dense_agrees_with_itself(run):
    for task, by_mode in run["results"].items():
        for mode in ("dense", "dense_again"):
            r = by_mode[mode]
            assert r["agreement_with_dense"] == 1.0, (task, mode)
            assert r["first_token_top1_agreement"] == 1.0, (task, mode)
            assert r["first_token_kl"] == pytest.approx(0.0, abs=1e-5), (task, mode)
            assert r["accuracy"] == by_mode["dense"]["accuracy"], (task, mode)


@pytest.mark.slow  # the benchmark's run over every task and mode
def test_spans_compute_no_more_than_dense(run):
    for task, by_mode in run["results"].items():
        assert by_mode["naive"]["extra_prefill_tokens_per_request"] == 0.0, task
        # dense's prefix hits may run a few tokens into documents that open alike (code's "def"); spans' cannot
        assert by_mode["dense"]["extra_prefill_tokens_per_request"] >= -8, task
        assert by_mode["dense"]["first_token_kl"] == 0.0, task


@pytest.mark.slow  # the benchmark's run over every task and mode
def test_recomputed_share_of_span_tokens(run):
    for task, by_mode in run["results"].items():
        assert by_mode["dense"]["recomputed_span_share"] == 1.0, task  # no spans: every document token attends fully
        assert by_mode["naive"]["recomputed_span_share"] == 0.0, task  # isolated spans: none
        assert 0 < by_mode["anchor+seams8"]["recomputed_span_share"] < 1, task  # each span's first and last 8


def test_mode_names():
    assert span_mode_name("none", 0) == "naive" and span_mode_name("auto", 0) == "anchor"
    assert span_mode_name("auto", 16) == "anchor+head16" and span_mode_name("none", 8) == "head8"
    assert span_mode_name("auto", 16, 16) == "anchor+seams16" and span_mode_name("none", 0, 8) == "tail8"
    assert span_mode_name("auto", 16, 8) == "anchor+head16+tail8"
    for k in (8, 16, 32):
        assert ALL_MODES[f"anchor+seams{k}"] == span_mode("auto", k, k)
    flags = "--span-anchor auto --span-head-tokens 16 --span-tail-tokens 16"
    assert ALL_MODES["anchor+seams16"].server_flags() == flags
    assert ALL_MODES["anchor+head16"].engine_kwargs == {"span_anchor": "auto", "span_head_tokens": 16}
    assert span_mode_name("auto", 0, 0, 0.1, select="lexical") == "anchor+lex10"
    lexical = "--span-anchor auto --span-head-tokens 0 --span-query-share 0.1 --span-select lexical"
    assert ALL_MODES["anchor+lex10"].server_flags() == lexical


def test_dense_and_span_prompts_are_the_same_ids(setup):
    model, template, _ = setup
    builder = PromptBuilder(str(model), str(model), str(template))
    sizes = bench.parse_args(SIZES).sizes
    for task in TASKS.values():
        for item in task.make(2, 0, sizes, builder.count):
            prompt = builder.build(item)
            assert SSEP_MARKER in prompt.marked, task.name  # documents (and tools) are spans
            segments = builder.request_builder.tokenize(prompt.marked)
            assert [t for s in segments for t in s.token_ids] == prompt.ids, task.name
            assert prompt.span_tokens == sum(len(s.token_ids) for s in segments if s.kind == "span") > 0, task.name
            for turn in item.earlier:  # the chat template renders the earlier turns, in order
                assert strip_markers(turn.content) in strip_markers(prompt.marked), task.name
            assert builder.tokenizer.decode(prompt.ids) == strip_markers(prompt.marked), task.name
            if not item.tools:  # documents end in a newline, so tokenizing the plain text whole cuts them alike
                assert prompt.plain_ids_match, task.name


def test_judging():
    assert judge(Gold(("1987",), ("1990",)), "It was founded in 1987.", []) == (True, "1987")
    assert judge(Gold(("1987",), ("1990",)), "1990, not 1987", [])[0] is False
    assert judge(Gold(("no",), ("yes",)), "No, they are not.", [])[0] is True
    assert judge(Gold(("Ebro", "Italy")), "The Ebro, in Spain.", [])[0] is False
    assert judge(Gold(("United States",)), "the United States.", [])[0] is True
    weather = ToolGold("get_weather", ("city",))
    assert judge(weather, "", [ToolCall("get_weather", '{"city": "Oslo"}')]) == (True, 'get_weather({"city": "Oslo"})')
    assert judge(weather, "", [ToolCall("get_weather", '{"town": "Oslo"}')])[0] is False
    assert judge(weather, "It is sunny.", []) == (False, "text: it is sunny")


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="qa_pool"):
        TaskSizes(qa_docs=5, qa_pool=3)
    with pytest.raises(ValueError, match="rag_corpus"):
        BenchTaskSizes(rag_passages=5, rag_corpus=3)
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "dense,nope"])


def test_a_task_draws_the_same_items_whatever_else_runs(setup):
    model, template, _ = setup
    builder = PromptBuilder(str(model), str(model), str(template))
    sizes = bench.parse_args(SIZES).sizes
    alone = Workload.build({"needle": TASKS["needle"]}, 3, 5, sizes, builder, "heldout")
    together = Workload.build(TASKS, 2, 5, sizes, builder, "heldout")
    assert alone.items["needle"][:2] == together.items["needle"]


def test_adapter_modes_serve_the_named_adapter(setup, tmp_path):
    """+adapter modes merge the adapter `--span-adapter` names; one whose factors multiply to zero answers as the base
    model does, to the last bit of its first-token distribution."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_pic.model_loader.span_adapter import save_adapter
    from sglang_pic.span_adapter.lora import add_lora, to_adapter

    model, template, _ = setup
    layers = add_lora(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), rank=2, alpha=2.0)
    save_adapter(tmp_path / "zero", to_adapter(layers, 2, 2.0, {}), str(model))  # B starts at zero
    output = tmp_path / "adapter.json"
    bench.main(["--model-path", str(model), "--chat-template", str(template), "--samples", "2", "--batch-size", "2",
                "--modes", "dense,dense+adapter,anchor+adapter", "--tasks", "needle", "--output", str(output),
                "--split", "tuning", "--span-adapter", str(tmp_path / "zero"), *SIZES])
    run = json.loads(output.read_text())
    assert run["config"]["span_adapter"] == str(tmp_path / "zero")
    assert run["modes"]["anchor+adapter"]["engine_kwargs"]["span_anchor"] == "auto"
    same = run["results"]["needle"]["dense+adapter"]
    assert same["agreement_with_dense"] == 1.0 and same["first_token_kl"] == pytest.approx(0.0, abs=1e-5)


def test_adapter_modes_need_the_adapter_folder():
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "dense,anchor+adapter"])
