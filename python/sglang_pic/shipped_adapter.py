"""The span adapter shipped for the embedded model (Qwen2.5-Coder-0.5B-Instruct), which `--span-adapter auto` names.

It is package data (`data/span_adapter/`: the LoRA in bf16, its config, and its record with the span settings it is
served at and how it was trained); `data/span_adapter/README.md` gives the command that made it. Its sha256 is
checked on every load, so a damaged install fails at start rather than serving a changed model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

AUTO = "auto"
FOLDER = Path(__file__).parent / "data" / "span_adapter"
WEIGHTS_SHA256 = "b9484c9b28a5669222eaf7399488eb7b096eb2bcaa0ce14de9d4842d3accda31"


def shipped_adapter() -> Path:
    """The shipped adapter's folder, its weights verified."""
    weights = FOLDER / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"span_adapter auto: the shipped adapter is missing ({weights}); reinstall sglang-pic")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise ValueError(f"span_adapter auto: {weights} has sha256 {digest}, not {WEIGHTS_SHA256}; "
                         "reinstall sglang-pic")
    return FOLDER
