"""What each --speculative-algorithm brings to an engine: the worker the scheduler decodes with, and the device memory
its drafts take beside the KV pool. The Engine and the scheduler process hand both down, so the scheduler and the
model runner never import an algorithm.
"""

from __future__ import annotations

from sglang_pic.server_args import ServerArgs
from sglang_pic.speculative.compressor_base import Compressor, create_compressor
from sglang_pic.speculative.vericache_worker import VeriCacheWorker


def spec_worker_factory(args: ServerArgs) -> type[VeriCacheWorker] | None:
    """The worker class of the algorithm (ServerArgs has checked its name); None: the scheduler decodes itself."""
    return VeriCacheWorker if args.speculative_algorithm == "vericache" else None


def draft_memory(args: ServerArgs) -> Compressor | None:
    """The compressor whose drafts the runner leaves device memory for when it sizes the KV pool."""
    return create_compressor(args.vericache_compressor) if args.speculative_algorithm == "vericache" else None
