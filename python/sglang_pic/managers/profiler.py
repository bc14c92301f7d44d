"""torch.profiler around scheduler steps: SGLang's /start_profile and /stop_profile, and Engine.start_profile.

A run records every step between start and stop (or `num_steps` steps that ran a forward, then stops by itself) and
writes one Chrome trace (open it in Perfetto or chrome://tracing) per replica into `output_dir`, by default
$SGLANG_TORCH_PROFILER_DIR or /tmp. Under tensor parallelism the trace is rank 0's.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

logger = logging.getLogger(__name__)

ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}
PROFILE_FIELDS = {"output_dir", "num_steps", "activities", "record_shapes"}


class StepProfiler:
    def __init__(self, name: str) -> None:
        self.name = name  # tells the traces of data-parallel replicas apart
        self._profile: torch.profiler.profile | None = None
        self._steps_left: int | None = None
        self.path: str | None = None  # the trace the running (or last) profile writes

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        record_shapes: bool = False,
    ) -> str:
        """Start recording; returns the trace's path. ValueError names a bad argument or a run already going."""
        if self.active:
            raise ValueError(f"a profile is already running (its trace goes to {self.path})")
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        if activities is None:
            activities = ["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"]
        if not isinstance(activities, list) or not activities or set(activities) - set(ACTIVITIES):
            raise ValueError(f"activities must be a non-empty list of {sorted(ACTIVITIES)}, got {activities!r}")
        if "GPU" in activities and not torch.cuda.is_available():
            raise ValueError("activity GPU needs CUDA")
        folder = Path(output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp"))
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot write traces to {str(folder)!r}: {e}") from None
        self.path = str(folder / f"{time.time_ns() // 1_000_000}-{self.name}.trace.json.gz")
        self._profile = torch.profiler.profile(
            activities=[ACTIVITIES[a] for a in dict.fromkeys(activities)], record_shapes=bool(record_shapes)
        )
        self._profile.start()
        self._steps_left = num_steps
        return self.path

    def step(self) -> None:
        """A step that ran a forward has ended: a run of `num_steps` steps stops after its last one."""
        if self._steps_left is not None and self.active:
            self._steps_left -= 1
            if self._steps_left == 0:
                logger.info("profiled the requested steps: %s", self.stop())

    def stop(self) -> str:
        """Stop recording and write the trace; returns its path."""
        if not self.active:
            raise ValueError("no profile is running")
        profile, self._profile = self._profile, None
        profile.stop()
        profile.export_chrome_trace(self.path)
        return self.path
