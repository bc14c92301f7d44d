"""A long-lived process under the Triton interpreter that runs one named kernel case (triton_cases.py) per request.

TRITON_INTERPRET must be set before triton is first imported, which a pytest process that also collects GPU-path
modules cannot promise. A worker started once per test module pays the torch and triton imports once, while every
test still sends its own case, fails alone and has its own hang timeout; a worker that dies or hangs fails only the
case it was running and is started afresh for the next one.

Protocol: the parent writes a case name per line on the worker's stdin and reads one JSON line per name from its
stdout; the cases' own prints go to stderr (a log file the parent quotes when a case crashes or hangs).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO

LIST_CASES = "--list"  # the request for {"cases": [every case name]}
LOG_TAIL_CHARS = 6000


class WorkerFailure(AssertionError):
    """The worker died or hung while running a case (a case's own exception comes back as its reply instead)."""


class InterpreterWorker:
    """The parent's handle: starts the worker on first use and again after a crash or a hang."""

    def __init__(self, hang_timeout_s: float) -> None:
        self.hang_timeout_s = hang_timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()
        handle, log = tempfile.mkstemp(prefix="triton_worker_", suffix=".log")
        os.close(handle)
        self._log = Path(log)

    def run(self, name: str) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        log_start = self._log.stat().st_size
        try:
            self._proc.stdin.write(name + "\n")
            self._proc.stdin.flush()
            reply = self._replies.get(timeout=self.hang_timeout_s)
        except queue.Empty:
            self._stop(kill=True)
            raise WorkerFailure(f"case {name} still running after {self.hang_timeout_s:.0f} s (a hang); worker log:\n"
                                f"{self._tail(log_start)}") from None
        except BrokenPipeError:
            reply = None
        if reply is None:
            code = self._proc.wait()
            tail = self._tail(log_start)
            self._proc = None
            raise WorkerFailure(f"the worker exited with code {code} while running case {name}; its log:\n{tail}")
        return json.loads(reply)

    def close(self) -> None:
        """Ends the worker and removes its log."""
        self._stop(kill=False)
        self._log.unlink(missing_ok=True)

    def _stop(self, kill: bool) -> None:
        """An idle worker exits once its stdin closes; a hung one, or one that does not exit, is killed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(timeout=0 if kill else 30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()

    def _start(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        with open(self._log, "ab") as log:  # the child keeps its own descriptor, appending
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
        self._replies = queue.Queue()
        threading.Thread(target=_forward_lines, args=(self._proc.stdout, self._replies), daemon=True).start()

    def _tail(self, start: int) -> str:
        with open(self._log, "rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]


def _forward_lines(stream: IO[str], replies: queue.Queue[str | None]) -> None:
    for line in stream:
        replies.put(line)
    replies.put(None)  # end of file: the worker exited


def serve() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the kernel cases must run under the Triton interpreter"
    assert "triton" not in sys.modules
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a case prints lands in the log, never among the replies
    import torch

    torch.set_num_threads(1)
    from triton_cases import CASES

    for line in sys.stdin:
        name = line.strip()
        if name == LIST_CASES:
            reply: dict = {"cases": sorted(CASES)}
        else:
            try:
                reply = CASES[name]()
            except Exception:  # the case's failure is its reply; the worker lives on for the next case
                reply = {"exception": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
