"""The server under soak as processes: one started here on a free loopback port, or a running one found by its
port; its scheduler process, whose RSS and CPU time the report follows."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """`python -m sglang_pic.launch_server` on a free loopback port, stopped (its whole session) on exit."""

    def __init__(self, model_path: str | None, extra: list[str], log_path: Path, startup_timeout_s: float) -> None:
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in extra):
                raise SystemExit(f"soak.py sets {flag} itself (loopback, a free port); drop it from the server flags")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_pic.launch_server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--model-path", model_path] if model_path else []
        self.log_path = log_path
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd + extra, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.startup_timeout_s = startup_timeout_s

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with code {self.proc.returncode}; its log: {self.log_path}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)  # direct: no proxy settings
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"the server was not healthy after {self.startup_timeout_s:.0f} s; its log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def scheduler_process(server_pid: int | None) -> psutil.Process | None:
    """The server's first multiprocessing worker child: launch_server starts the scheduler before the others."""
    if server_pid is None:
        return None
    try:
        workers = [
            p for p in psutil.Process(server_pid).children()
            if any("spawn_main" in part for part in p.cmdline())
        ]
    except psutil.Error:
        return None
    return min(workers, key=lambda p: (p.create_time(), p.pid), default=None)


def listener_pid(port: int) -> int | None:
    """The pid of this user's process listening on 127.0.0.1:`port`, if psutil can see it."""
    for proc in psutil.process_iter():
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return proc.pid
        except psutil.Error:
            continue
    return None


def rss_mib(proc: psutil.Process | None) -> float | None:
    try:
        return proc.memory_info().rss / 2**20 if proc is not None else None
    except psutil.Error:
        return None


def growth(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def cpu_or_none(proc: psutil.Process | None) -> float | None:
    try:
        return cpu_s(proc) if proc is not None else None
    except psutil.Error:
        return None
