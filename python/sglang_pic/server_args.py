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
    schedule_policy: str = "fcfs"  # fcfs | lpm
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
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.attention_backend not in (None, "torch_native", "triton"):
            raise ValueError(f"attention_backend must be torch_native or triton, got {self.attention_backend!r}")
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
