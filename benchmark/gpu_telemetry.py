"""SM clock, power and throttle reasons sampled by nvidia-smi while a benchmark runs.

Under its power cap an H200 lowers the SM clock for as long as the draw stays high, and a kernel that does more
work per byte loses more to that than its baseline does. A result row that carries the clocks and throttle reasons
of the seconds it was measured in says whether a difference was the code or the cap.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from datetime import datetime

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
# clocks_throttle_reasons bits that lower the clock under load: software power cap, hardware slowdown, software and
# hardware thermal slowdown, hardware power brake (0x1, idle, and 0x2, application clocks, say nothing about load)
LOAD_THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class Sample:
    time: float  # seconds since the epoch, from nvidia-smi's local timestamp
    sm_mhz: int
    power_w: float
    throttle: int  # clocks_throttle_reasons.active bit mask


def parse_sample(line: str) -> Sample | None:
    """One line of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`; None for anything else."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        when = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return Sample(when, int(fields[1]), float(fields[2]), int(fields[3], 16))
    except ValueError:
        return None


class Telemetry:
    """Samples every `period_ms` in a background nvidia-smi process until close(); `window` summarizes the samples
    taken between two `time.time()` values. Samples may reach the pipe late (nvidia-smi buffers its output unless
    stdbuf is there to stop it), so ask for windows after close(). Without nvidia-smi every window is empty."""

    def __init__(self, period_ms: int = 100, command: str = "nvidia-smi") -> None:
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        path = shutil.which(command)
        if path is None:
            return
        args = [path, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"]
        if shutil.which("stdbuf"):
            args = ["stdbuf", "-oL", *args]
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)

    def window(self, start: float, end: float) -> dict:
        """Samples in [start, end]: their count, the lowest SM clock, the highest power and whether any carried a
        throttle reason of LOAD_THROTTLE_BITS (`throttled`)."""
        with self._lock:
            inside = [s for s in self.samples if start <= s.time <= end]
        if not inside:
            return {"samples": 0}
        return {
            "samples": len(inside),
            "min_sm_mhz": min(s.sm_mhz for s in inside),
            "max_power_w": max(s.power_w for s in inside),
            "throttled": any(s.throttle & LOAD_THROTTLE_BITS for s in inside),
        }

    def close(self) -> None:
        """Stop sampling; nvidia-smi exits on an interrupt as on Ctrl-C, writing out what it still holds."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._reader.join()
            self._proc = None

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
