"""Model shape and runtime settings read from a HF folder's config.json (transformers 4 and 5 layouts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sglang_pic.quant_config import resolve_quantization

if TYPE_CHECKING:
    from sglang_pic.server_args import ServerArgs

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _with_overrides(cfg: dict[str, Any], json_model_override_args: str) -> dict[str, Any]:
    """config.json with SGLang's --json-model-override-args merged in: its top-level keys replace the file's."""
    if not json_model_override_args:
        return cfg
    try:
        overrides = json.loads(json_model_override_args)
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-model-override-args is not valid JSON: {e}") from e
    if not isinstance(overrides, dict):
        raise ValueError(f"--json-model-override-args must be a JSON object, got {type(overrides).__name__}")
    return {**cfg, **overrides}


def rope_scaling_type(rope_scaling: dict | None) -> str:
    """The scaling's kind: HF configs name it `rope_type` (newer) or `type` (older, e.g. Qwen2.5's model card)."""
    scaling = rope_scaling or {}
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _rope(cfg: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None): transformers 5 folds both into `rope_parameters`.

    A yarn scaling gets transformers' defaults filled in: the original window is a top-level
    `original_max_position_embeddings` if the config has one (Phi-3 style), else the scaling's own, else
    max_position_embeddings; a missing factor is max_position_embeddings over that window (DeepSeek style).
    """
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params)
    rope_type = rope_scaling_type(scaling)
    if rope_type == "default":
        return theta, None
    if rope_type == "yarn":
        window = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(window or max_pos)
        if scaling.get("factor") is None:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return theta, scaling


def _max_context(max_pos: int, scaling: dict[str, Any] | None) -> int:
    """Longest context the model serves. YaRN stretches the pretraining window `factor` times, as vLLM and SGLang
    count it; Qwen2.5 keeps max_position_embeddings at that window (32K) while its model card promises 128K with
    factor 4. llama3 and linear configs already state their long context in max_position_embeddings."""
    if rope_scaling_type(scaling) != "yarn":
        return max_pos
    return max(max_pos, int(scaling["original_max_position_embeddings"] * scaling["factor"]))


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: str) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmuls are slow and inexact there) and the checkpoint's dtype on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32
    return _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.bfloat16)


SAME_MODEL_FIELDS = (
    "architecture", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
    "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "sliding_window", "quantization",
)


@dataclass
class ModelConfig:
    model_path: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    context_len: int
    dtype: torch.dtype
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    quantization: str | None = None  # fp8: the linear layers hold fp8 weights (quant_config.py)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def differences(self, other: "ModelConfig") -> list[str]:
        """The fields that fix the parameters' shapes and the model's math on which `other` differs: weights of a
        checkpoint can replace the served ones only where there are none."""
        return [
            f"{name} {getattr(other, name)!r} != {getattr(self, name)!r}"
            for name in SAME_MODEL_FIELDS
            if getattr(other, name) != getattr(self, name)
        ]

    @classmethod
    def from_server_args(cls, path: str, args: "ServerArgs", device: str | None = None) -> "ModelConfig":
        """The config every server process builds from ServerArgs (context length, dtype, config overrides); `device`
        defaults to the args' own, processes that only tokenize pass "cpu"."""
        return cls.from_path(
            path,
            context_length=args.context_length,
            dtype=args.dtype,
            device=device or args.resolved_device(),
            json_model_override_args=args.json_model_override_args,
            quantization=args.quantization,
        )

    @classmethod
    def from_path(
        cls,
        path: str,
        context_length: int | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        json_model_override_args: str = "",
        quantization: str | None = None,
    ) -> "ModelConfig":
        """Read `path`/config.json (+ generation_config.json), with `json_model_override_args` (a JSON object)
        merged over it. For GGUF, pass `resolve_model_path`'s folder. `quantization` is --quantization's; an fp8
        checkpoint is fp8 without it."""
        folder = Path(path)
        cfg = _read_json(folder / "config.json")
        if not cfg:
            raise FileNotFoundError(
                f"no config.json in {path!r}; for a .gguf file resolve it first with "
                "sglang_pic.model_loader.resolve_model_path(path, 'gguf')"
            )
        cfg = _with_overrides(cfg, json_model_override_args)
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"config.json in {path!r} names no architectures")
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        theta, scaling = _rope(cfg, max_pos)
        max_context = _max_context(max_pos, scaling)
        if context_length is not None and context_length > max_context:
            if max_context > max_pos:
                limit = f"{max_pos} positions stretched by yarn rope_scaling"
            elif scaling is None:
                limit = "max_position_embeddings; yarn rope_scaling set through --json-model-override-args lifts it"
            else:
                limit = "max_position_embeddings"
            raise ValueError(f"context_length {context_length} exceeds the model's context {max_context} ({limit})")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = _read_json(folder / "generation_config.json")
        eos = list(dict.fromkeys(_as_id_list(cfg.get("eos_token_id")) + _as_id_list(gen.get("eos_token_id"))))
        return cls(
            model_path=str(path),
            architecture=archs[0],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            num_hidden_layers=cfg["num_hidden_layers"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            context_len=context_length or max_context,
            dtype=resolve_dtype(dtype, cfg.get("dtype") or cfg.get("torch_dtype"), device),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            hidden_act=cfg.get("hidden_act", "silu"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            quantization=resolve_quantization(quantization, cfg),
            hf_config=cfg,
        )
