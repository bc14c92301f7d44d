"""benchmark/gpu_telemetry.py on the CPU: a stand-in nvidia-smi prints samples; the sampler reads and sums them up."""

from __future__ import annotations

import os
import stat
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from gpu_telemetry import Telemetry, parse_sample  # noqa: E402

# Prints the query's columns every --loop-ms like nvidia-smi: a line at full clock, one capped at 700 W, one idle.
FAKE_SMI = """#!{python}
import sys, time
from datetime import datetime
assert "--format=csv,noheader,nounits" in sys.argv, sys.argv
period = int([a for a in sys.argv if a.startswith("--loop-ms=")][0].split("=")[1]) / 1000
rows = [("1980", "612.5", "0x0000000000000000"), ("1425", "700.3", "0x0000000000000004"), ("345", "70.0", "0x1")]
i = 0
while True:
    clock, power, reasons = rows[i % 3]
    stamp = datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{stamp}}, {{clock}}, {{power}}, {{reasons}}", flush=True)
    i += 1
    time.sleep(period)
"""


def test_parse_sample() -> None:
    sample = parse_sample("2026/12/01 23:01:00.104, 1965, 658.94, 0x0000000000000004\n")
    assert sample is not None
    assert (sample.sm_mhz, sample.power_w, sample.throttle) == (1965, 658.94, 4)
    assert sample.time == datetime(2026, 12, 1, 23, 1, 0, 104000).timestamp()
    assert parse_sample("timestamp, clocks.current.sm [MHz], power.draw [W], clocks_throttle_reasons.active") is None
    assert parse_sample("[N/A]") is None


def test_windows_summarize_the_samples_taken_in_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with Telemetry(period_ms=20) as telemetry:
        start = time.time()
        deadline = start + 10
        while len(telemetry.samples) < 6 and time.time() < deadline:
            time.sleep(0.02)
        end = time.time()
        window = telemetry.window(start - 1, end + 1)
        assert telemetry.window(end + 60, end + 61) == {"samples": 0}
    assert window["samples"] >= 6
    assert window["min_sm_mhz"] == 345 and window["max_power_w"] == 700.3
    assert window["throttled"]  # the power-cap bit
    for clock in (1980, 345):  # no reason, and the idle reason alone: neither throttles under load
        sample = next(s for s in telemetry.samples if s.sm_mhz == clock)
        assert telemetry.window(sample.time, sample.time)["throttled"] is False


def test_without_nvidia_smi_every_window_is_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with Telemetry() as telemetry:
        assert telemetry.window(0, time.time()) == {"samples": 0}
