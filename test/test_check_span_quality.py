"""`python -m sglang_pic.check_span_quality` on a tiny model: it says what it runs, prints a row per task and
setting and a mean per setting, and recommends one of the settings it ran by the rule it states; and that rule
on hand-made numbers. A random tiny model answers nothing right, so only the report's shape and the
recommendation's consistency are checked, not its choice."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_bench_span_quality import qwen2_with_tools

from sglang_pic import check_span_quality as check
from sglang_pic.span_quality import span_mode
from sglang_pic.span_quality_tasks import TASKS

SMALL = ["--qa-docs", "2", "--qa-pool", "3", "--num-tools", "2", "--needle-spans", "3", "--needle-pool", "3",
         "--depth-buckets", "2"]
SETTINGS = ("naive", "anchor", "anchor+head16")


@pytest.fixture(scope="module")
def model_and_template(tiny_model_root) -> tuple[Path, Path]:
    return qwen2_with_tools(tiny_model_root)


def test_prints_the_table_and_recommends_a_setting_it_ran(model_and_template, capsys, monkeypatch):
    model, template = model_and_template
    for name, task in TASKS.items():  # short replies: a random model never stops, and the report's shape is the point
        monkeypatch.setitem(TASKS, name, replace(task, max_new_tokens=6))
    pick = check.main(["--model-path", str(model), "--chat-template", str(template), "--samples", "2",
                       "--head-tokens", "0,16", *SMALL])
    out = capsys.readouterr().out
    lines = out.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("task ")))
    assert "starting an engine" in "\n".join(lines[:table])  # said before the long steps, not after
    assert lines[table].split() == ["task", "setting", "accuracy", "agree", "top1", "extra", "tok/req"]
    rows = {tuple(line.split()[:2]) for line in lines[table + 2 :]}
    for task in TASKS:
        for setting in ("dense", *SETTINGS):
            assert (task, setting) in rows, (task, setting)
    for setting in SETTINGS:
        assert ("mean", setting) in rows, setting
    assert pick.name in SETTINGS
    assert f"recommended: {pick.name}:" in out
    assert "rule: the cheapest setting" in out and "within 0.05 of the best" in out
    assert lines[-1] == f"server flags: {pick.mode.server_flags()}"
    assert lines[-1].startswith("server flags: --span-anchor ")


def _score(name: str, anchor: str, head: int, agreement: float, extra: float) -> check.SettingScore:
    return check.SettingScore(name, span_mode(anchor, head), agreement, agreement, extra)


SCORES = [
    _score("naive", "none", 0, 0.50, 0.0),
    _score("anchor", "auto", 0, 0.55, 0.0),
    _score("anchor+head16", "auto", 16, 0.90, 120.0),
    _score("anchor+head32", "auto", 32, 0.93, 240.0),
    _score("anchor+head64", "auto", 64, 0.95, 480.0),
]


def test_recommendation_is_the_cheapest_setting_near_the_best():
    assert check.recommend(SCORES, 0.05).name == "anchor+head16"  # costlier than spans alone; 0.90 is within 0.05
    assert check.recommend(SCORES, 0.02).name == "anchor+head32"
    assert check.recommend(SCORES, 0.0).name == "anchor+head64"
    assert check.recommend(SCORES, 1.0).name == "anchor"  # as cheap as naive, and agrees more
    assert check.recommend(SCORES[:2], 0.05).name == "anchor"
    assert check.recommend(SCORES[2:], 0.05).mode.server_flags() == "--span-anchor auto --span-head-tokens 16"


@pytest.mark.parametrize("flags", [["--head-tokens", "16,16"], ["--head-tokens", "-1"], ["--head-tokens", "x"],
                                   ["--tasks", "rag_two_hop"], ["--tolerance", "2"], ["--needle-spans", "2"]])
def test_bad_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        check.parse_args(flags)
    assert "error" in capsys.readouterr().err
