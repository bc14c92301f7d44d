"""Start and stop `python -m sglang_pic.launch_server` as a subprocess on a free port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

START_TIMEOUT_S = 180.0
# Small and exact: float32, a small KV pool and little logging keep a tiny-model server fast on 2 cores.
DEFAULT_ARGS = ("--dtype", "float32", "--max-total-tokens", "4096", "--log-level", "warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def get(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 120)
        return requests.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, **kw)


def start_server(model_path: str | Path, *extra_args: str, api_key: str | None = None) -> ServerProcess:
    """Launch a server and wait for /health; raise with the server's log if it dies or never gets healthy."""
    return wait_healthy(spawn_server(model_path, *extra_args, api_key=api_key))


def spawn_server(model_path: str | Path, *extra_args: str, api_key: str | None = None) -> ServerProcess:
    """Launch a server without waiting (so several can load at once); then `wait_healthy` it."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_pic.launch_server", "--model-path", str(model_path), "--port", str(port)]
    cmd += [*DEFAULT_ARGS, *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    log = tempfile.NamedTemporaryFile(prefix="sglang_pic_server_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", Path(log.name), api_key)
    if api_key:
        server.headers = {"Authorization": f"Bearer {api_key}"}
    return server


def wait_healthy(server: ServerProcess) -> ServerProcess:
    """Wait for /health; raise with the server's log (stopping it) if it dies or never gets healthy.

    Interrupted (Ctrl-C), it stops the server too: the server runs in its own session, which Ctrl-C does not
    reach, and no fixture teardown knows of it yet, so it would outlive the test run."""
    proc = server.proc
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}:\n{server.log_tail()}")
            try:
                if requests.get(server.url + "/health", timeout=1).status_code == 200:
                    return server
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server did not become healthy in {START_TIMEOUT_S}s:\n{server.log_tail()}")
    except BaseException:
        stop_server(server)
        raise


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited


def stop_server(server: ServerProcess, timeout: float = 15.0) -> int | None:
    """SIGTERM the server and wait; if it hangs, kill the process group it was started in."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    return server.proc.returncode
