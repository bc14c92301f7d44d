"""sglang_pic: an SGLang-shaped serving engine whose KV cache is position-free, so spans are reused anywhere."""

from sglang_pic.server_args import ServerArgs

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str):
    if name == "Engine":
        from sglang_pic.engine import Engine

        return Engine
    raise AttributeError(name)
