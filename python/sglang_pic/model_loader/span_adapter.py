"""A span adapter on disk, and its merge into checkpoint tensors as they are loaded.

The files are PEFT's LoRA format (adapter_config.json, adapter_model.safetensors with `...lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]), so an adapter trained with peft loads too, plus span_adapter.json: how it was trained
and the span settings it was trained for, which become the server's span defaults. It is served one of two ways:
  * merged (`merged_weights`): (lora_alpha / r) * B @ A added to each targeted HF-named weight before the model
    packs or shards it, so packed q/k/v, tensor parallelism and CUDA graphs see plain weights: no cost per token,
    but every request runs under the adapter;
  * apart (`attach_row_lora`): each targeted linear keeps its slice of the factors and adds them on the rows of
    requests under span attention only (layers/row_lora.py), so dense requests run on the base weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from sglang_pic.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear
from sglang_pic.layers.row_lora import AdapterRows, RowLora
from sglang_pic.models.llama import packed_module

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
RECORD = "span_adapter.json"
PEFT_PREFIX = "base_model.model."


@dataclass
class SpanAdapter:
    """LoRA factors per HF module name (e.g. model.layers.0.self_attn.q_proj): (A [r, in], B [out, r])."""

    rank: int
    alpha: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    record: dict[str, Any] = field(default_factory=dict)  # span_adapter.json: span_settings, training, base_model

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def span_settings(self) -> dict[str, Any]:
        return dict(self.record.get("span_settings", {}))

    def delta(self, module: str) -> torch.Tensor:
        a, b = self.factors[module]
        return self.scale * (b.float() @ a.float())


def save_adapter(folder: str | Path, adapter: SpanAdapter, base_model: str) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in sorted(adapter.factors.items()):
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.detach().contiguous().cpu()
    save_file(tensors, folder / WEIGHTS)
    targets = sorted({m.rpartition(".")[2] for m in adapter.factors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank, "lora_alpha": adapter.alpha,
              "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "lora_dropout": 0.0,
              "base_model_name_or_path": base_model}
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (folder / RECORD).write_text(json.dumps(adapter.record, indent=2) + "\n")


def load_adapter(folder: str | Path) -> SpanAdapter:
    """Read an adapter folder; raise ValueError naming what is missing or unsupported."""
    folder = Path(folder)
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise ValueError(f"span adapter {str(folder)!r} has no {name}")
    config = json.loads((folder / CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("fan_in_fan_out") or config.get("bias", "none") != "none":
        raise ValueError(f"span adapter {str(folder)!r}: only LoRA without biases or fan-in-fan-out is supported")
    record = json.loads((folder / RECORD).read_text()) if (folder / RECORD).is_file() else {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(folder / WEIGHTS, framework="pt", device="cpu") as f:
        for key in f.keys():
            stem, _, part = key.removesuffix(".weight").rpartition(".")
            if part not in ("lora_A", "lora_B"):
                raise ValueError(f"span adapter {str(folder)!r}: unexpected tensor {key!r}")
            halves.setdefault(stem.removeprefix(PEFT_PREFIX), {})[part] = f.get_tensor(key)
    factors = {}
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"span adapter {str(folder)!r}: {module} lacks one of lora_A, lora_B")
        factors[module] = (pair["lora_A"], pair["lora_B"])
    return SpanAdapter(int(config["r"]), float(config["lora_alpha"]), factors, record)


def merged_weights(weights: Iterator[tuple[str, torch.Tensor]], adapter: SpanAdapter
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (HF name, tensor) pairs with the adapter's deltas added (in float32, stored back in the
    tensor's dtype); raise if a module of the adapter never came by or a shape disagrees."""
    left = set(adapter.factors)
    for name, tensor in weights:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in adapter.factors:
            delta = adapter.delta(module)
            if delta.shape != tensor.shape:
                raise ValueError(f"span adapter delta for {module} has shape {tuple(delta.shape)}, the checkpoint "
                                 f"{tuple(tensor.shape)}: the adapter was trained for another model")
            tensor = (tensor.float() + delta).to(tensor.dtype)
            left.discard(module)
        yield name, tensor
    if left:
        raise ValueError(f"span adapter targets {len(left)} modules the checkpoint lacks, e.g. {sorted(left)[:2]}")


def attach_row_lora(model: nn.Module, adapter: SpanAdapter) -> None:
    """Give each targeted linear of a loaded `model` this rank's slice of the adapter as a RowLora, all reading one
    AdapterRows that becomes `model.adapter_rows`. Packed projections (q|k|v, gate|up) stack their parts' A and
    place each part's B rows in its own columns; a row-parallel layer takes A's columns of its input slice. Raise
    if the model has no such layer, quantizes it, or a shape disagrees."""
    modules = dict(model.named_modules())
    grouped: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for hf_module, (a, b) in adapter.factors.items():
        name, part = packed_module(hf_module)
        if not isinstance(modules.get(name), Linear):
            raise ValueError(f"span adapter targets {hf_module}, which {type(model).__name__} has no linear for")
        grouped.setdefault(name, {})[part] = (a.float(), adapter.scale * b.float())
    rows = AdapterRows(model.model.embed_tokens.weight.dtype)
    for name, parts in grouped.items():
        layer = modules[name]
        if layer.quant is not None:
            raise ValueError("a span adapter served apart from the weights needs dense ones; merge it to use fp8")
        a, b = _packed(layer, parts) if isinstance(layer, MergedColumnParallelLinear) else parts[None]
        if isinstance(layer, RowParallelLinear):
            if a.shape[1] != layer.in_shard.full:
                raise ValueError(f"span adapter A of {name} has {a.shape[1]} inputs, the layer {layer.in_shard.full}")
            a = layer.input_slice(a)
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise ValueError(f"span adapter factors of {name} ({tuple(b.shape)} x {tuple(a.shape)}) do not fit "
                             f"its weight ({layer.out_features}, {layer.in_features})")
        layer.lora = RowLora(layer.weight, a, b, rows)
    model.adapter_rows = rows


def _packed(layer: MergedColumnParallelLinear, parts: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for a packed layer: the parts' A stacked, and B with each part's rows of this rank in the columns
    of its own A (zero where a part has no adapter)."""
    names = [p for p in layer.parts if p in parts]
    a = torch.cat([parts[p][0] for p in names])
    b = a.new_zeros(layer.out_features, a.shape[0])
    col = 0
    for p in names:
        pa, pb = parts[p]
        layer.weight_loader(b[:, col : col + pa.shape[0]], pb, p)  # its rows, as the part's weight takes them
        col += pa.shape[0]
    return a, b
