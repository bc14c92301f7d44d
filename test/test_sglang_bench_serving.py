"""SGLang's own benchmark client against the server: `python -m sglang.bench_serving` through its native (`sglang`,
/generate) and OpenAI (`sglang-oai`, /v1/completions) backends, on synthetic datasets that need no download. Every
request must succeed: bench_serving counts failed requests out of `completed` instead of failing itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


BENCH_TIMEOUT_S = 300  # only catches a hang; a run takes seconds
DATASETS = {
    "random-ids": (
        ["--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1"],
        6,
    ),
    "generated-shared-prefix": (
        [
            "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "24",
            "--gsp-question-len", "8", "--gsp-output-len", "4",
        ],
        6,
    ),
}


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.mark.parametrize(
    "backend,dataset",
    # each backend and each dataset once: a run is mostly the client's start-up (seconds), the same for every pair
    [("sglang", "random-ids"), ("sglang-oai", "generated-shared-prefix")],
)
def test_bench_serving_completes_every_request(server, tiny_llama, tmp_path, backend, dataset):
    flags, expected = DATASETS[dataset]
    result_file = tmp_path / "result.jsonl"
    cmd = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", server.url,
        "--tokenizer", str(tiny_llama), "--dataset-name", dataset, *flags, "--seed", "1", "--disable-tqdm",
        "--output-file", str(result_file),
    ]
    # Offline, and its generated-prompt cache (under ~/.cache) kept inside the test's folder.
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, env=env, cwd=tmp_path)
    report = f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert run.returncode == 0, report
    result = json.loads(result_file.read_text().splitlines()[-1])
    assert result["completed"] == expected, report
    assert result["total_output_tokens"] == expected * 4, report
