"""Llama decoder, also the base of the Qwen2, Qwen3 and Mistral models (they differ only in small switches).

The model never rotates q or k: it hands them unrotated to RadixAttention, whose backend stores keys unrotated
and applies RoPE from logical positions.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sglang_pic.distributed.parallel_state import get_tp_group
from sglang_pic.distributed.sharding import even_shard, kv_head_shard
from sglang_pic.forward_batch import ForwardBatch
from sglang_pic.layers.activation import GatedAct
from sglang_pic.layers.layernorm import RMSNorm
from sglang_pic.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang_pic.layers.quant_fp8 import ACTIVATION_SCALE_NAMES, FP8, quantize_rows
from sglang_pic.layers.radix_attention import RadixAttention
from sglang_pic.layers.row_lora import AdapterRows
from sglang_pic.layers.rotary_embedding import RotaryEmbedding
from sglang_pic.layers.vocab_parallel_embedding import VocabParallelEmbedding, vocab_parallel_logits
from sglang_pic.model_config import ModelConfig

# HF projection name -> (our merged module name, shard key).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def packed_module(hf_module: str) -> tuple[str, str | None]:
    """Our module for an HF-named one (model.layers.0.self_attn.q_proj -> ...qkv_proj) and the packed part it fills
    (None: not packed)."""
    parent, _, proj = hf_module.rpartition(".")
    ours, part = PACKED_MODULES.get(proj, (proj, None))
    return (f"{parent}.{ours}" if parent else hf_module), part


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        # This rank's heads; with tp_size 1, all of them.
        self.num_heads = even_shard(config.num_attention_heads, tp.rank, tp.size, "num_attention_heads").size
        self.num_kv_heads = kv_head_shard(config.num_key_value_heads, tp.rank, tp.size).size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        quant = config.quantization
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias,
            quant=quant,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias, quant=quant
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id, rotary
        )

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(-1, self.kv_size)
        return self.o_proj(self.attn(q, k, v, forward_batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear.split_evenly(
            config.hidden_size, {"gate": inter, "up": inter}, bias=config.mlp_bias, quant=config.quantization
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=config.mlp_bias, quant=config.quantization)
        self.act = GatedAct(config.hidden_act, fp8_out=config.quantization == "fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, **attn_flags: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary, **attn_flags)
        self.mlp = LlamaMLP(config)
        # Each feeds one linear only (q|k|v, gate|up): with fp8 weights it may quantize for it.
        fp8 = config.quantization == "fp8"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp8_out=fp8)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp8_out=fp8)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, **attn_flags: bool) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim,
            max_position=config.context_len,
            base=config.rope_theta,
            rope_scaling=config.rope_scaling,
            device=torch.get_default_device(),
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, **attn_flags) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        deviation = forward_batch.deviation
        for layer in self.layers if deviation is None else self.layers[: deviation.layer + 1]:
            hidden, residual = layer(hidden, residual, forward_batch)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Switches the subclasses flip; Llama reads its biases from the config.
    qkv_bias: bool | None = None
    qk_norm: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.check_config(config)
        qkv_bias = config.attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = config.attention_bias if self.qkv_bias is None else False
        self.model = LlamaModel(config, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=self.qk_norm)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # A span adapter served apart from the weights (model_loader/span_adapter.attach_row_lora); None: none is.
        self.adapter_rows: AdapterRows | None = None

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Refuse configs whose semantics this implementation would silently get wrong."""
        window = config.sliding_window
        if window is not None and window < config.context_len:
            raise NotImplementedError(
                f"{cls.__name__}: sliding-window attention (window {window} < context {config.context_len}) is "
                f"not supported; pass context_length <= {window}"
            )

    @property
    def rotary(self) -> RotaryEmbedding:
        return self.model.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. Positions reach RoPE through `forward_batch`."""
        if self.adapter_rows is not None:
            self.adapter_rows.set(forward_batch.span_adapter_rows, any(forward_batch.span_adapter_rows_cpu))
        return self.model(input_ids, forward_batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors, packing q/k/v and gate/up; a layer with a `weight_loader` takes its own
        tensor-parallel slice. An fp8 layer takes an fp8 weight with its `weight_scale` as stored, or a dense weight
        it quantizes here per output row (after any span adapter was merged into it). Raise if any parameter (or
        packed part) stays unloaded."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected = {
            (f"{mod_name}.{leaf}", shard)
            for mod_name, mod in modules.items()
            for leaf, _ in mod.named_parameters(recurse=False)
            for shard in getattr(mod, "shard_names", (None,))
        }
        loaded: set[tuple[str, str | None]] = set()
        for hf_name, tensor in weights:
            module_name, _, leaf = hf_name.rpartition(".")
            if (
                "rotary_emb." in hf_name
                or leaf in ACTIVATION_SCALE_NAMES
                or (hf_name == "lm_head.weight" and self.lm_head is None)
            ):
                continue
            module, shard = packed_module(module_name)
            name = f"{module}.{leaf}" if module else hf_name
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__}")
            param = params[name]
            if (param.dtype == FP8) != (tensor.dtype == FP8) and tensor.dtype.itemsize == 1:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} is {tensor.dtype}, which {name} ({param.dtype}) cannot take"
                )
            if param.dtype == FP8 and tensor.dtype != FP8:
                tensor, scale = quantize_rows(tensor.to(param.device))
                self._load_param(modules, f"{name}_scale", params[f"{name}_scale"], scale, shard)
                loaded.add((f"{name}_scale", shard))
            self._load_param(modules, name, param, tensor, shard)
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")

    @staticmethod
    def _load_param(
        modules: dict[str, nn.Module], name: str, param: torch.Tensor, tensor: torch.Tensor, shard: str | None
    ) -> None:
        module = modules[name.rpartition(".")[0]]
        if hasattr(module, "weight_loader"):
            module.weight_loader(param, tensor, shard)
        elif param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        else:
            with torch.no_grad():
                param.copy_(tensor)
