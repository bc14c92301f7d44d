"""All engine and server settings in one dataclass, named as in SGLang so its users feel at home."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    load_format: str = "auto"  # auto | dummy | gguf
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    context_length: int | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None
    chat_template: str | None = None

    # Memory and caching.
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    page_size: int = 1
    max_running_requests: int = 256
    disable_radix_cache: bool = False

    # Scheduling.
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    schedule_policy: str | None = None  # fcfs | lpm | isps; default isps with PIC, fcfs with --disable-pic
    step_token_budget: int | None = None  # prefill tokens per ISPS step next to the decodes (default: chunk size)
    isps_max_wait_steps: int = 32  # ISPS serves any work that has waited this many steps first
    schedule_conservativeness: float = 1.0
    enable_mixed_chunk: bool = False

    # Kernels.
    attention_backend: str | None = None  # torch_native | triton; default picks by device
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160

    # Position-independent caching.
    disable_pic: bool = False
    ssep_marker: str = "<|ssep|>"
    pdep_marker: str = "<|pdep|>"
    ssep_token_id: int = -1
    pdep_token_id: int = -2

    # Lossless compressed-KV speculation (VeriCache).
    speculative_algorithm: str | None = None  # None | vericache
    speculative_num_draft_tokens: int | None = None
    vericache_compressor: str = "streaming"  # streaming | snapkv | h2o | kivi
    vericache_budget: float = 0.25  # < 1: fraction of the context kept for drafting; >= 1: tokens kept
    vericache_full_kv: str = "gpu"  # gpu | host

    # Server.
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    random_seed: int = 0
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.load_format not in ("auto", "dummy", "gguf"):
            raise ValueError(f"load_format must be auto, dummy or gguf, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.schedule_policy is None:
            self.schedule_policy = "fcfs" if self.disable_pic else "isps"
        if self.schedule_policy not in ("fcfs", "lpm", "isps"):
            raise ValueError(f"schedule_policy must be fcfs, lpm or isps, got {self.schedule_policy!r}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.attention_backend not in (None, "torch_native", "triton"):
            raise ValueError(f"attention_backend must be torch_native or triton, got {self.attention_backend!r}")
        if self.speculative_algorithm not in (None, "vericache"):
            raise ValueError(f"speculative_algorithm must be vericache, got {self.speculative_algorithm!r}")
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch_native"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server arguments: {', '.join(unknown)}")
        return cls(**kwargs)
