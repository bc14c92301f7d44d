"""A process of the engine that dies becomes a clear error naming it, never a hang: a tensor-parallel follower of the
offline Engine that cannot start (the classic cause: a script without the `if __name__ == "__main__":` guard) or is
killed mid-run, and a server child (a data-parallel scheduler, a tensor-parallel follower) that dies at start-up.
The Engine cases run as scripts in a subprocess, whose timeout only catches a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from server_utils import child_pids, pid_alive, spawn_server, stop_server

from sglang_pic.utils_process import exit_status

HANG_S = 240


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S
    )


def test_engine_without_main_guard_fails_fast(tmp_path, tiny_llama):
    """The spawned follower re-imports the script, which starts an engine again and fails in bootstrapping; the
    parent's Engine(...) must raise naming the follower and the missing guard instead of waiting for it."""
    result = run_script(
        tmp_path,
        f"""
        import sglang_pic

        engine = sglang_pic.Engine(model_path={str(tiny_llama)!r}, dtype="float32", max_total_tokens=512, tp_size=2)
        print("STARTED")
        """,
    )
    assert result.returncode != 0
    assert "STARTED" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("RuntimeError: tensor-parallel rank 1")]
    assert errors, result.stderr[-3000:]
    assert "(process tp1" in errors[0] and 'if __name__ == "__main__":' in errors[0] and "script.py" in errors[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_follower_killed_mid_run_raises(tmp_path, tiny_llama, device):
    """A follower killed while a request streams: the stream, and every call after it, raises naming the follower;
    shutdown still returns. On CUDA the NCCL group must be aborted, or the collectives would wait forever."""
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
    result = run_script(
        tmp_path,
        f"""
        import os, signal
        from multiprocessing.connection import wait

        import sglang_pic

        def expect_failure(call):
            try:
                call()
            except RuntimeError as e:
                print("FAILED:", e)
            else:
                print("NO ERROR")

        if __name__ == "__main__":
            engine = sglang_pic.Engine(
                model_path={str(tiny_llama)!r}, dtype="float32", max_total_tokens=512, tp_size=2, device={device!r}
            )
            params = {{"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}
            follower = engine._replica.followers[0].process

            def stream_and_kill():
                for i, _ in enumerate(engine.generate("Once upon a time", params, stream=True)):
                    if i == 0:
                        os.kill(follower.pid, signal.SIGKILL)
                        wait([follower.sentinel])

            expect_failure(stream_and_kill)
            expect_failure(lambda: engine.generate("The quick brown fox", params))
            engine.shutdown()
            print("SHUT DOWN")
        """,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "SHUT DOWN"
    failures = [line for line in lines if line.startswith(("FAILED", "NO ERROR"))]
    assert len(failures) == 2
    for line in failures:
        assert line.startswith("FAILED: tensor-parallel rank 1 (process tp1") and "signal SIGKILL" in line, line


def worker_pids(server_pid: int) -> list[int]:
    """The server's children in the order it started them (pids grow), without multiprocessing's resource
    tracker."""
    pids = []
    for pid in child_pids(server_pid):
        try:
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return sorted(pids)


@pytest.mark.parametrize(
    "flags,victim,name",
    [(("--dp-size", "2"), 1, "the scheduler-dp1 process"),
     pytest.param(("--tp-size", "2"), 1, "(process tp1", marks=pytest.mark.slow)],
    ids=["dp-scheduler", "tp-follower"],
)
def test_server_child_dying_at_start_up_stops_the_server(tiny_llama, flags, victim, name):
    """Children start as [scheduler(s) with their followers..., detokenizer]; the victim is killed at once, long
    before the model is loaded."""
    srv = spawn_server(tiny_llama, *flags)
    try:
        deadline = time.monotonic() + HANG_S
        while len(workers := worker_pids(srv.pid)) < 3 and srv.proc.poll() is None:
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.02)
        os.kill(workers[victim], signal.SIGKILL)
        srv.proc.wait(HANG_S)
        assert srv.proc.returncode != 0
        log = srv.log_tail()
        assert name in log and "during start-up" in log and exit_status(-signal.SIGKILL) in log, log
        assert not any(pid_alive(pid) for pid in workers)
    finally:
        stop_server(srv)
