"""What every server process shares: where the model files are, logging, leaving when the parent is gone, and
saying how a process ended."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

LOG_FORMAT = "[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s"


@dataclass
class ModelFiles:
    """The HF folders resolved once in the main process (a GGUF is converted there, see
    model_loader.resolve_model_files), so children never race."""

    model_dir: str
    tokenizer_dir: str


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)


def prepare_child(level: str) -> int:
    """Set up a child process; return its parent's pid so the child can notice becoming an orphan.

    Ctrl-C reaches the whole process group; children ignore it and let the main process stop them in order.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(level)
    return os.getppid()


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def check_parent(parent_pid: int) -> None:
    """Raise RuntimeError once the process that started this one is gone (for waits that must not outlive it)."""
    if not parent_alive(parent_pid):
        raise RuntimeError(f"the parent process (pid {parent_pid}) is gone")


def exit_status(exitcode: int | None) -> str:
    """A process's end as people read it: `exit code 1`, `signal SIGKILL`."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"
