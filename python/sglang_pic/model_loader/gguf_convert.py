"""One-time GGUF -> safetensors conversion, so the engine only ever loads HF-format folders.

Transformers dequantizes the GGUF (weights, config and tokenizer); we save the result once under
<cache>/gguf/<key>, where key hashes the file's absolute path and size. A lock file serializes concurrent
converters and a marker file tells a finished folder from one a crash left half written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

_DONE_MARKER = ".converted"
_STORE_DTYPE = torch.bfloat16  # GGUF blocks come from bf16 checkpoints; bf16 halves the cache against float32


def gguf_cache_dir(gguf_file: Path, cache_root: Path) -> Path:
    path = gguf_file.resolve()
    key = hashlib.sha256(f"{path}:{path.stat().st_size}".encode()).hexdigest()[:24]
    return cache_root / "gguf" / f"{path.stem}-{key}"


def convert_gguf(gguf_file: Path, cache_root: Path) -> Path:
    """Return the converted folder for `gguf_file`, converting it on first call."""
    out = gguf_cache_dir(gguf_file, cache_root)
    if (out / _DONE_MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / _DONE_MARKER).is_file():
            shutil.rmtree(out, ignore_errors=True)
            tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _dequantize_to(gguf_file.resolve(), tmp)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantize_kwargs() -> dict:
    """Transformers >= 5.24 keeps GGUF blocks packed unless told otherwise; older versions always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _dequantize_to(gguf_file: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=_STORE_DTYPE, **_dequantize_kwargs())
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain dense tensors
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / _DONE_MARKER).write_text(json.dumps({"source": str(gguf_file), "size": gguf_file.stat().st_size}))
