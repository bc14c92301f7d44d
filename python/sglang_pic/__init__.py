"""sglang_pic: an SGLang-shaped serving engine whose KV cache is position-free, so spans are reused anywhere."""

import sys

from sglang_pic.import_path import drop_checkout_roots

drop_checkout_roots(sys.path)  # first: the checkout's top-level folders must not shadow installed packages

from sglang_pic.server_args import ServerArgs  # noqa: E402

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str):
    if name == "Engine":
        from sglang_pic.engine import Engine

        return Engine
    raise AttributeError(name)
