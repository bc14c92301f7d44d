"""Build a model on its device and fill its weights: from safetensors (auto), a GGUF file (gguf) or a seed (dummy)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sglang_pic.layers.layernorm import RMSNorm
from sglang_pic.layers.quant_fp8 import FP8, quantize_rows, require_fp8_gemm
from sglang_pic.model_config import ModelConfig, resolve_dtype
from sglang_pic.model_loader.gguf_convert import convert_gguf
from sglang_pic.model_loader.span_adapter import attach_row_lora, load_adapter, merged_weights
from sglang_pic.models.registry import get_model_class
from sglang_pic.quant_config import checkpoint_quantization
from sglang_pic.server_args import ServerArgs
from sglang_pic.utils_process import ModelFiles

DUMMY_STD = 0.02


def cache_root() -> Path:
    """Where converted models live; SGLANG_PIC_CACHE overrides ~/.cache/sglang_pic."""
    return Path(os.environ.get("SGLANG_PIC_CACHE") or Path.home() / ".cache" / "sglang_pic")


def _find_gguf(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) > 1:
        raise ValueError(f"{path} holds several .gguf files ({', '.join(f.name for f in found)}); name one")
    return found[0] if found else None


def resolve_model_path(model_path: str, load_format: str = "auto") -> str:
    """The HF-format folder to read config, weights and tokenizer from, converting a GGUF once if needed.

    A .gguf file (or a folder holding one) is converted when load_format is gguf, or under auto/dummy when no
    config.json sits beside it. A folder with config.json is returned as is, so calling this twice is harmless.
    """
    path = Path(model_path).expanduser()
    has_config = path.is_dir() and (path / "config.json").is_file()
    gguf = _find_gguf(path)
    if gguf is not None and (load_format == "gguf" or not has_config):
        return str(convert_gguf(gguf, cache_root()))
    if has_config:
        return str(path)
    raise FileNotFoundError(f"{model_path!r} is neither a HF model folder (with config.json) nor a .gguf file")


def model_dirs(model_path: str | None, tokenizer_path: str | None, load_format: str = "auto") -> tuple[str, str]:
    """(model folder, tokenizer folder) as Engine resolves them: no model_path means the embedded default model."""
    if model_path is None:
        from sglang_pic.model_loader.default_model import default_model_path  # it imports this module

        model_dir = default_model_path()
    else:
        model_dir = resolve_model_path(model_path, load_format)
    return model_dir, tokenizer_path or model_dir


def resolve_model_files(args: ServerArgs) -> ModelFiles:
    """The model and tokenizer folders of a server, resolved once in its main process for every child."""
    model_dir = resolve_model_path(args.model_path, args.load_format)
    tokenizer_dir = args.tokenizer_path if args.tokenizer_path not in (None, args.model_path) else model_dir
    return ModelFiles(model_dir, tokenizer_dir)


def safetensors_files(folder: str) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors in the folder."""
    root = Path(folder)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / name for name in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder!r} (PyTorch .bin checkpoints are not supported)")
    return files


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded N(0, DUMMY_STD) weights and unit norms, drawn on the model's device so large models init fast. An fp8
    layer's weight is drawn as a dense one, in the same order, and quantized into it and its `weight_scale`."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generator, seen = None, set()
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # a tied weight is drawn once, as model.parameters() yields it once
                    continue
                seen.add(id(param))
                if id(param) in norms:
                    param.fill_(1.0)
                    continue
                if name == "weight_scale":
                    continue
                if generator is None:
                    generator = torch.Generator(device=param.device).manual_seed(seed)
                if param.dtype != FP8:
                    param.normal_(0.0, DUMMY_STD, generator=generator)
                    continue
                dense = torch.empty(param.shape, device=param.device, dtype=torch.float32)
                weight, scale = quantize_rows(dense.normal_(0.0, DUMMY_STD, generator=generator))
                param.copy_(weight)
                module.weight_scale.copy_(scale)


def load_model(
    config: ModelConfig,
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    span_adapter: str | None = None,
    span_adapter_scope: str = "spans",
) -> nn.Module:
    """Instantiate `config.architecture` on `device` in `dtype` (default config.dtype) and load its weights, then
    quantize them if `config.quantization` says so (models quantize dense weights of fp8 layers as they load them).
    A span adapter (a folder) is merged into the weights before that (`span_adapter_scope` "all") or kept apart for
    the rows of requests under span attention ("spans"; model_loader/span_adapter.py)."""
    if load_format not in ("auto", "dummy", "gguf"):
        raise ValueError(f"unknown load_format {load_format!r}")
    if span_adapter is not None and checkpoint_quantization(config.hf_config):
        raise ValueError(
            "a span adapter merges into dense weights; this checkpoint stores fp8 ones. Serve its bf16 original "
            "with --quantization fp8 instead"
        )
    device = torch.device(device)
    if config.quantization is not None:
        require_fp8_gemm(device)
    dtype = config.dtype if dtype in (None, "auto") else resolve_dtype(dtype, None, device.type)
    with _default_dtype(dtype), device:
        model = get_model_class(config.architecture)(config)
    merged = span_adapter if span_adapter_scope == "all" else None
    if load_format == "dummy":
        if merged is not None:
            raise ValueError("a span adapter merges into checkpoint weights, not dummy ones (scope spans can serve "
                             "one beside them, e.g. to measure its cost)")
        init_dummy_weights(model, seed)
    else:
        model.load_weights(checkpoint_weights(resolve_model_path(config.model_path, load_format), merged))
    if span_adapter is not None and merged is None:
        attach_row_lora(model, load_adapter(span_adapter))
    return model.eval().requires_grad_(False)


def checkpoint_weights(folder: str, span_adapter: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's HF-named tensors, with the span adapter (a folder; None: none) merged in."""
    weights = iter_safetensors(folder)
    return weights if span_adapter is None else merged_weights(weights, load_adapter(span_adapter))
