"""Run a test module's checks under the Triton interpreter in a child process, for tests of one Triton kernel file.

TRITON_INTERPRET must be set before triton is imported, so the module runs itself with `--child` in a fresh
interpreter with it set and prints one JSON report as its last line; the test process never imports triton.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def interpreted_report(test_file: str, timeout_s: float = 300) -> dict:
    """The JSON report `python test_file --child` prints under TRITON_INTERPRET=1; skips the test without triton."""
    if importlib.util.find_spec("triton") is None:  # find_spec, not import: triton must stay out of this process
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, str(Path(test_file).resolve()), "--child"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
