"""A long-lived process under the Triton interpreter that runs one named kernel case (triton_cases.py) per request.

TRITON_INTERPRET must be set before triton is first imported, which a pytest process that also collects GPU-path
modules cannot promise. A worker started once per test module pays the torch and triton imports once, while every
test still sends its own case, fails alone and has its own hang timeout; a worker that dies or hangs fails only the
case it was running and is started afresh for the next one. A WorkerPool runs several at once, one per core.

Protocol: the parent writes a case name per line on the worker's stdin and reads one JSON line per name from its
stdout; the cases' own prints go to stderr (a log file the parent quotes when a case crashes or hangs).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from concurrent.futures import Future
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

    def kill(self) -> None:
        """Ends the case running now, from another thread: its `run` fails as for a crash."""
        proc = self._proc
        if proc is not None:
            proc.kill()

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
        # One thread per worker: workers run side by side, and idle OpenMP threads spinning beside the other
        # worker's took half of each core on 2 cores.
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
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


class WorkerPool:
    """Several workers running cases at once, for the cases a module's tests will ask for, queued up front.

    A worker keeps one core busy (the interpreter is single-threaded Python), so one per core share the module's
    cases: while a test waits for its own reply, another worker already runs a later test's case. Each case still has
    its own hang timeout and fails alone (InterpreterWorker); `run` re-raises its failure in its test."""

    def __init__(self, hang_timeout_s: float, size: int) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, str | None, Future | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._prefetched: dict[str, list[Future]] = {}
        self._workers = [InterpreterWorker(hang_timeout_s) for _ in range(size)]
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True) for w in self._workers]
        for thread in self._threads:
            thread.start()

    def prefetch(self, names: list[str]) -> None:
        """Queue these cases in this order, to be taken by `run` later."""
        for name in names:
            self._prefetched.setdefault(name, []).append(self._submit(name, priority=1))

    def run(self, name: str) -> dict:
        """The reply to `name`: its prefetched run, or else a run queued ahead of every prefetched one."""
        queued = self._prefetched.get(name)
        future = queued.pop(0) if queued else self._submit(name, priority=0)
        return future.result()

    def close(self) -> None:
        """Drops the cases not started; a case still running (its test deselected or stopped by -x) is killed."""
        while True:
            try:
                _, _, _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        for _ in self._threads:
            self._queue.put((-1, next(self._order), None, None))
        for worker, thread in zip(self._workers, self._threads):
            thread.join(timeout=1)
            if thread.is_alive():
                worker.kill()
                thread.join()
            worker.close()

    def _submit(self, name: str, priority: int) -> Future:
        future: Future = Future()
        self._queue.put((priority, next(self._order), name, future))
        return future

    def _serve(self, worker: InterpreterWorker) -> None:
        while True:
            _, _, name, future = self._queue.get()
            if future is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(worker.run(name))
            except BaseException as e:  # noqa: BLE001 - the test that waits for the case re-raises it
                future.set_exception(e)


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
    from triton_interpreter_patch import install

    install()
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
