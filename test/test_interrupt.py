"""Ctrl-C stops a test run and the servers it started, even a run started with SIGINT ignored, as a script's
background job (`python -m pytest test &`) is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import server_utils
from server_utils import START_TIMEOUT_S, ServerProcess, free_port, pid_alive, wait_healthy

TEST_DIR = Path(__file__).parent
# A run whose one test holds a server fixture's server and then waits, as a long test does when Ctrl-C comes.
SERVER_CASE = '''
import os
import time
from pathlib import Path

import pytest
from server_utils import start_server, stop_server


@pytest.fixture(scope="module")
def server():
    srv = start_server(os.environ["TINY_LLAMA"])
    yield srv
    stop_server(srv)


def test_waits(server):
    Path(os.environ["SERVER_PID_FILE"]).write_text(str(server.pid))
    time.sleep(3600)
'''
EXIT_S = 300.0  # generous: teardown stops the server, then the interpreter exits, on a loaded 2-core machine


@pytest.mark.slow
def test_sigint_stops_a_run_started_with_sigint_ignored(tmp_path: Path, tiny_llama: Path):
    case = tmp_path / "test_case.py"
    case.write_text(SERVER_CASE)
    pid_file = tmp_path / "server.pid"
    env = {**os.environ, "SERVER_PID_FILE": str(pid_file), "TINY_LLAMA": str(tiny_llama),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TEST_DIR), os.environ.get("PYTHONPATH")]))}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(case)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    server_pid = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + EXIT_S
        while not pid_file.is_file() or not pid_file.read_text():
            if run.poll() is not None:
                pytest.fail("the run ended before its server was up:\n" + run.communicate()[0])
            assert time.monotonic() < deadline, "the run's server did not come up"
            time.sleep(0.5)
        server_pid = int(pid_file.read_text())
        os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C does: the terminal signals the foreground process group
        out = run.communicate(timeout=EXIT_S)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            if server_pid is not None and pid_alive(server_pid):
                os.kill(server_pid, signal.SIGTERM)  # in its own session, which the kill above does not reach
    assert run.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "KeyboardInterrupt" in out, out
    assert not pid_alive(server_pid), "the fixture's server outlived the interrupted run"


def test_interrupted_wait_for_health_stops_the_server(monkeypatch: pytest.MonkeyPatch):
    """The server runs in its own session, which Ctrl-C does not reach: interrupted while it starts, the wait
    stops it, as no teardown knows of it yet."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    server = ServerProcess(proc, f"http://127.0.0.1:{free_port()}", Path(os.devnull))

    def interrupted(*args, **kwargs) -> requests.Response:
        raise KeyboardInterrupt

    monkeypatch.setattr(server_utils.requests, "get", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            wait_healthy(server)
        assert proc.poll() is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
