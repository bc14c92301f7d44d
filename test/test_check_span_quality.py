"""`python -m sglang_pic.check_span_quality` on a tiny model: it says what it runs, prints a row per task and
setting and a mean per setting on the tuning items, recommends one of the settings it ran by the rule it states,
then reports that setting (with dense and isolated spans) on the held-out items; and that rule on hand-made
numbers. A random tiny model answers nothing right, so only the report's shape and the recommendation's
consistency are checked, not its choice. Its --help reads as plain text and shows every default."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_bench_span_quality import qwen2_with_tools

from sglang_pic.span_quality import check
from sglang_pic.span_quality.modes import span_mode
from sglang_pic.span_quality.recommend import SettingScore, recommend
from sglang_pic.span_quality.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--qa-docs", "2", "--qa-pool", "3", "--num-tools", "2", "--needle-spans", "3", "--needle-pool", "3",
         "--depth-buckets", "2"]
SETTINGS = ("naive", "anchor", "anchor+head16", "anchor+seams8", "anchor+lex10")
# Three of the tasks keep this a fast test (the benchmark's test runs them all): spans in the user turn, in an earlier
# turn, and as tools.
CHECKED_TASKS = ("needle", "multi_turn", "tool_selection")


@pytest.fixture(scope="module")
def model_and_template(tiny_model_root) -> tuple[Path, Path]:
    return qwen2_with_tools(tiny_model_root)


def test_prints_the_table_and_recommends_a_setting_it_ran(model_and_template, capsys, monkeypatch):
    model, template = model_and_template
    for name, task in TASKS.items():  # short replies: a random model never stops, and the report's shape is the point
        monkeypatch.setitem(TASKS, name, replace(task, max_new_tokens=6))
    result = check.main(["--model-path", str(model), "--chat-template", str(template), "--samples", "2",
                         "--head-tokens", "0,16", "--seam-tokens", "8", "--tasks", ",".join(CHECKED_TASKS), *SMALL])
    pick = result.pick
    out = capsys.readouterr().out
    lines = out.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("task ")]
    assert len(tables) == 2  # the tuning items', then the held-out items'
    assert "starting an engine" in "\n".join(lines[: tables[0]])  # said before the long steps, not after
    assert lines[tables[0] - 1].startswith("tuning items") and lines[tables[1] - 1].startswith("held-out items")
    for at in tables:
        assert lines[at].split() == ["task", "setting", "accuracy", "agree", "top1", "recomp", "extra", "tok/req"]

    def rows(start: int, end: int) -> set[tuple[str, ...]]:
        return {tuple(line.split()[:2]) for line in lines[start:end]}

    tuning, heldout = rows(tables[0] + 2, tables[1]), rows(tables[1] + 2, len(lines))
    for task in CHECKED_TASKS:
        for setting in ("dense", *SETTINGS):
            assert (task, setting) in tuning, (task, setting)
        for setting in ("dense", "naive", pick.name):
            assert (task, setting) in heldout, (task, setting)
    for setting in SETTINGS:
        assert ("mean", setting) in tuning, setting
    assert pick.name in SETTINGS and result.heldout.name == pick.name and result.heldout.mode == pick.mode
    assert f"recommended: {pick.name}:" in out and f"held out: {pick.name}: agreement with dense" in out
    assert "rule: the cheapest setting" in out and "on every task is within 0.01 of dense" in out
    assert lines[-1] == f"server flags: {pick.mode.server_flags()}"
    assert lines[-1].startswith("server flags: --span-anchor ")


def _score(name: str, anchor: str, head: int, agreement: float, extra: float, gap: float) -> SettingScore:
    return SettingScore(name, span_mode(anchor, head), agreement, agreement, extra, agreement, 0.0, gap)


SCORES = [
    _score("naive", "none", 0, 0.50, 0.0, 0.40),
    _score("anchor", "auto", 0, 0.55, 0.0, 0.35),
    _score("anchor+head16", "auto", 16, 0.90, 120.0, 0.05),
    _score("anchor+head32", "auto", 32, 0.93, 240.0, 0.02),
    _score("anchor+head64", "auto", 64, 0.95, 480.0, 0.0),
]


def test_recommendation_is_the_cheapest_setting_near_dense_on_every_task():
    assert recommend(SCORES, 0.05).name == "anchor+head16"  # costlier than spans alone; 0.05 below at worst
    assert recommend(SCORES, 0.02).name == "anchor+head32"
    assert recommend(SCORES, 0.0).name == "anchor+head64"
    assert recommend(SCORES, 1.0).name == "anchor"  # as cheap as naive, and closer to dense
    assert recommend(SCORES[:2], 0.05).name == "anchor"  # none fits: the one whose worst task is closest
    assert recommend(SCORES[2:], 0.05).mode.server_flags() == "--span-anchor auto --span-head-tokens 16"


@pytest.mark.parametrize("flags", [["--head-tokens", "16,16"], ["--head-tokens", "-1"], ["--head-tokens", "x"],
                                   ["--head-tokens", ""], ["--seam-tokens", "0"], ["--seam-tokens", "8,8"],
                                   ["--tasks", "rag_two_hop"], ["--tolerance", "2"], ["--needle-spans", "2"],
                                   ["--long-tokens", "100,150"], ["--lexical-shares", "0"],
                                   ["--lexical-shares", "x"], ["--lexical-shares", "0.1,0.1"]])
def test_bad_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        check.parse_args(flags)
    assert "error" in capsys.readouterr().err


def test_help_is_plain_text_with_every_default_and_the_cpu_run_time():
    """The documented command's --help: no markup in the description, each flag's default beside it (flags without
    one say what happens instead) and how long the default run takes on a CPU."""
    run = subprocess.run([sys.executable, "-m", "sglang_pic.check_span_quality", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    usage, description, options = run.stdout.split("\n\n", 2)
    assert usage.startswith("usage: python -m sglang_pic.check_span_quality ")
    assert description.startswith("A quick span-quality run on your own model") and "`" not in run.stdout
    entries = re.split(r"\n  (?=-)", options.split("options:\n", 1)[1])
    for entry in entries[1:]:  # the first is -h
        assert "(default: " in " ".join(entry.split()), entry
    flat = " ".join(run.stdout.split())
    assert "--samples SAMPLES items per task in each split (default: 8)" in flat
    assert "(default: 0,16,32,64,128)" in flat and "(default: 1024,4096)" in flat
    assert re.search(r"Run time on a CPU: .* On 2 CPU cores .* estimated \d+ to \d+ hours", flat), flat
