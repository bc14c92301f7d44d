"""The agent tool-use benchmark end to end on a tiny qwen2 server (CPU, --quick), and its trace generator.

No timing is compared (CPU timings are noise) and the tiny random model never calls a tool correctly; the cache
counters are what must hold: on a trace whose tool sets drift, spans reuse more of the prompt than a prefix cache.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_agent_tools  # noqa: E402
from agent_workload import WorkloadConfig, arguments_valid, build_workload  # noqa: E402

MODES = ("prefix_cache", "tool_spans", "result_spans")
FIELDS = ("ttft_p50_s", "ttft_p99_s", "ttft_p50_by_turn_s", "output_tokens_per_s", "total_tokens_per_s",
          "prefill_tokens_computed", "cached_tokens", "cache_hit_ratio", "tool_call_accuracy", "server_call_rate",
          "right_tool_rate", "agreement_with_reference", "tool_change_turns", "tool_change_share",
          "tool_change_history_tokens", "tool_change_history_share", "tool_change_hit_ratio", "tool_change_ttft_p50_s",
          "same_tools_ttft_p50_s")


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory) -> tuple[dict, Path]:
    from tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("agent_tools")
    model = build_tiny_model(root, "qwen2", max_position_embeddings=4096)  # tool JSON is long in the tiny vocab
    template = root / "tools.jinja"
    template.write_text(bench_agent_tools.HERMES_TEMPLATE)
    out = root / "results" / "agent_tools.json"
    bench_agent_tools.main(
        ["--quick", "--modes", ",".join(MODES), "--model-path", str(model), "--chat-template", str(template),
         "--out", str(out), "--change-prob", "0.7",  # every session's tools drift
         "--server-arg=--span-head-tokens", "--server-arg=4"]  # the quick results are shorter than the default head
    )
    return json.loads(out.read_text()), out


@pytest.mark.slow  # three tiny servers, one after the other
def test_every_mode_reports_every_turn(agent_run):
    result, out = agent_run
    assert out.with_suffix(".png").stat().st_size > 0
    assert list(result["modes"]) == list(MODES)
    turns = result["workload"]["turns"]
    assert turns == 3 * 3 and result["workload"]["tool_set_changes"] > 0
    for name, mode in result["modes"].items():
        assert all(mode[f] is not None for f in FIELDS), name
        assert mode["turns"] == len(mode["records"]) == turns, name
        assert all(r["ttft_s"] > 0 for r in mode["records"]), name
        assert len(mode["ttft_p50_by_turn_s"]) == 3, name
        assert 0 <= mode["tool_call_accuracy"] <= 1 and 0 <= mode["agreement_with_reference"] <= 1, name
        assert mode["prefill_tokens_computed"] == mode["prompt_tokens"] - mode["cached_tokens"], name
    assert result["modes"]["prefix_cache"]["agreement_with_reference"] == 1


@pytest.mark.slow  # three tiny servers, one after the other
def test_tool_change_turns_prefill_their_history(agent_run):
    result, _ = agent_run
    workload = result["workload"]
    changes = workload["tool_set_changes"]
    for name, mode in result["modes"].items():
        assert mode["tool_change_turns"] == changes, name
        assert mode["tool_change_share"] == pytest.approx(changes / (workload["turns"] - workload["sessions"]))
        changed = [r for r in mode["records"] if r["tools_changed"]]
        assert len(changed) == changes and all(r["turn"] > 0 for r in changed), name
        assert all(r["history_tokens"] is None for r in mode["records"] if not r["tools_changed"]), name
        for r in changed:
            # The history (earlier turns' messages, calls and results) sits between the tools and the new message,
            # and is keyed on the tools before it: the turn prefilled all of it, but for results that are spans.
            assert 0 < r["history_tokens"] < r["prompt_tokens"], (name, r)
            if name != "result_spans":
                assert r["prompt_tokens"] - r["cached_tokens"] >= r["history_tokens"], (name, r)
        assert mode["tool_change_history_tokens"] == sum(r["history_tokens"] for r in changed), name
        assert 0 < mode["tool_change_history_share"] <= 1, name
        assert mode["tool_change_history_share"] == pytest.approx(
            mode["tool_change_history_tokens"] / mode["prefill_tokens_computed"]), name


@pytest.mark.slow  # three tiny servers, one after the other
def test_spans_reuse_more_of_a_drifting_trace(agent_run):
    modes = agent_run[0]["modes"]
    assert modes["tool_spans"]["cached_tokens"] > modes["prefix_cache"]["cached_tokens"]
    # Tool results as spans: a turn whose tools changed reads its earlier results from the cache.
    assert modes["result_spans"]["tool_change_hit_ratio"] > modes["tool_spans"]["tool_change_hit_ratio"]


QUICK = WorkloadConfig(num_tools=6, description_tokens=(39, 78), sessions=4, turns=(3, 6), session_tools=(3, 5),
                       result_tokens=(26, 78), change_prob=0.5, seed=3)


def test_workload_is_deterministic_and_each_task_has_its_tool():
    first = build_workload(QUICK)
    assert first == build_workload(QUICK)
    assert build_workload(replace(QUICK, seed=4)) != first
    assert len(first.catalog) == 6 and len({t.name for t in first.catalog}) == 6
    for session in first.sessions:
        assert 3 <= len(session.turns) <= 6
        assert list(session.turns[0].tools) == sorted(session.turns[0].tools)  # registration order
        for turn in session.turns:
            assert turn.target in turn.tools and 3 <= len(turn.tools) <= 5
            assert first.catalog[turn.target].action in turn.task
    assert first.summary()["tool_set_changes"] > 0
    stable = build_workload(replace(QUICK, stable=True))
    assert all(len({t.tools for t in s.turns}) == 1 for s in stable.sessions)


def test_validator_checks_required_keys_and_json_types():
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                               "tags": {"type": "array"}}, "required": ["city"]}
    assert arguments_valid(schema, '{"city": "Oslo", "days": 3, "tags": ["a"]}')
    assert arguments_valid(schema, '{"city": "Oslo", "extra": 1}')
    for bad in ('{"days": 3}', '{"city": 4}', '{"city": "Oslo", "days": true}', '{"city": "Oslo", "days": 2.5}',
                '["Oslo"]', '{"city": "Oslo"', ""):
        assert not arguments_valid(schema, bad), bad


def test_a_call_left_as_text_is_read_when_the_reply_is_only_that_call():
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for text in (call, f"```json\n{call}\n```", f" ```\n{call}```\n"):
        assert bench_agent_tools.call_in_text(text) == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    for text in (f"Call {call}", f"```json\n{call}\n``` and more", '{"name": "get_weather"}', "[]", "sunny"):
        assert bench_agent_tools.call_in_text(text) is None, text
