"""Model implementations and their registry."""

from sglang_pic.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
