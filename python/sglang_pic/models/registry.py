"""Maps a config's `architectures[0]` to its model class, importing model modules only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        supported = ", ".join(supported_architectures())
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    module = importlib.import_module(f"sglang_pic.models.{_MODELS[architecture]}")
    return getattr(module, architecture)
