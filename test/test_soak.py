"""benchmark/soak.py for a short while on a tiny model: 32 clients sending the whole mix (native, OpenAI, tools with
tool_spans, constrained decoding, hang-ups, aborts, bad inputs) get no 5xx and no hung request, every bad input a
4xx, and the KV pool is idle after the drain; and an idle server's scheduler does not spin."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from server_utils import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import soak  # noqa: E402
from soak_client import BAD_CASES  # noqa: E402
from soak_report import format_report  # noqa: E402
from soak_server import cpu_s, scheduler_process  # noqa: E402

# Renders each tool as one JSON line, as Qwen2.5's template does, so tool_spans finds them.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IDLE_WINDOW_S = 3.0
IDLE_CPU_LIMIT_S = 0.5  # a scheduler that polls without blocking burns about the whole window


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    template = tmp_path_factory.mktemp("soak") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    # 1024 positions instead of 256: a chat listing all three tools fits (tool JSON is long in the tiny vocabulary).
    overrides = json.dumps({"max_position_embeddings": 1024})
    srv = start_server(tiny_qwen2, "--chat-template", str(template), "--json-model-override-args", overrides)
    yield srv
    stop_server(srv)


def test_idle_scheduler_uses_no_cpu(server):
    scheduler = scheduler_process(server.pid)
    assert scheduler is not None
    assert server.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}}).ok
    time.sleep(0.5)  # let the request's last step and output pass
    before = cpu_s(scheduler)
    time.sleep(IDLE_WINDOW_S)
    assert cpu_s(scheduler) - before < IDLE_CPU_LIMIT_S


@pytest.mark.slow  # a 20 s soak
def test_soak_short(server):
    config = soak.SoakConfig(
        url=server.url, clients=32, duration_s=20.0, request_timeout_s=120.0, drain_timeout_s=120.0,
        idle_cpu_window_s=IDLE_WINDOW_S, idle_cpu_limit_s=IDLE_CPU_LIMIT_S,
    )
    report = asyncio.run(soak.run_soak(config, server.pid))
    summary = format_report(report)
    assert report["skipped_kinds"] == {}, summary
    totals = report["totals"]
    assert totals["5xx"] == 0 and totals["hung"] == 0 and totals["transport_errors"] == 0, summary
    assert totals["failures"] == 0, summary
    kinds = report["kinds"]
    for case in BAD_CASES:
        stats = kinds[f"bad:{case}"]
        assert stats["count"] > 0 and stats["4xx"] == stats["count"], (case, summary)
    for name, stats in kinds.items():
        if not name.startswith("bad:"):
            assert stats["2xx"] == stats["count"], (name, summary)
    assert kinds["abort"]["aborted"] + kinds["abort:stream"]["aborted"] > 0, summary
    assert report["kv_after_drain"]["idle"], summary
    assert report["kv_after_flush"]["all_free"], summary
    assert report["scheduler"]["idle_cpu_s"] < IDLE_CPU_LIMIT_S, summary
    assert report["passed"], summary
