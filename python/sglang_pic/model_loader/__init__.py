"""Model loading: safetensors, dummy and GGUF weights, and the embedded default model."""

from sglang_pic.model_loader.default_model import default_model_path
from sglang_pic.model_loader.loader import load_model, resolve_model_path

__all__ = ["default_model_path", "load_model", "resolve_model_path"]
