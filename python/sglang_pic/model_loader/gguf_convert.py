"""One-time GGUF -> safetensors conversion, so the engine only ever loads HF-format folders.

Transformers dequantizes the GGUF (weights, config and tokenizer); we save the result once under
<cache>/gguf/<key>, where key hashes the file's absolute path and size. A lock file serializes concurrent
converters and a marker file tells a finished folder from one a crash left half written. A GGUF names one EOS token;
the folder's generation config lists every end-of-generation token of the vocabulary, as llama.cpp stops on
(Qwen's <|endoftext|> beside <|im_end|>, as its own HF release lists). The conversion's progress bars show only
when stderr is a terminal: in a log file every redraw is one more line of noise.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

_DONE_MARKER = ".converted"
_STORE_DTYPE = torch.bfloat16  # GGUF blocks come from bf16 checkpoints; bf16 halves the cache against float32
_LAYOUT = 2  # what a converted folder holds; folders of an older layout are converted again
# Token texts that end a generation in the chat formats GGUF models use (llama.cpp's end-of-generation tokens).
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
                     "<|end|>")


def gguf_cache_dir(gguf_file: Path, cache_root: Path) -> Path:
    path = gguf_file.resolve()
    key = hashlib.sha256(f"{path}:{path.stat().st_size}:{_LAYOUT}".encode()).hexdigest()[:24]
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
                with progress_bars_on_terminal():
                    _dequantize_to(gguf_file.resolve(), tmp)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def progress_bars_on_terminal() -> Iterator[None]:
    """Transformers' progress bars only if stderr is a terminal. Its own bars follow its switch; its GGUF reader
    calls tqdm directly, so that module's tqdm is swapped for one that is off, for the duration."""
    if sys.stderr is not None and sys.stderr.isatty():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    reader_tqdm = getattr(gguf_reader, "tqdm", None)
    hf_logging.disable_progress_bar()
    if reader_tqdm is not None:
        gguf_reader.tqdm = functools.partial(reader_tqdm, disable=True)
    try:
        yield
    finally:
        if reader_tqdm is not None:
            gguf_reader.tqdm = reader_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


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
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = end_of_generation_ids(tokenizer.get_vocab(), eos)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / _DONE_MARKER).write_text(json.dumps({"source": str(gguf_file), "size": gguf_file.stat().st_size}))


def end_of_generation_ids(vocab: dict[str, int], eos: int | list[int] | None) -> list[int]:
    """The GGUF's EOS id(s) first, then the ids of the vocabulary's END_OF_GENERATION tokens."""
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return list(dict.fromkeys(ids + [vocab[t] for t in END_OF_GENERATION if t in vocab]))
