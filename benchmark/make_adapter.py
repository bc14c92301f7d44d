"""Write a span adapter of random LoRA factors shaped for a model folder's config, for --load-format dummy runs.

What serving an adapter apart from the weights costs (layers/row_lora.py) depends on the model's shape and the
adapter's rank, not on the factors' values: a random adapter beside dummy weights measures it on any shape without
a trained one. B is nonzero, so tests also see it change answers.

Usage: python benchmark/make_adapter.py --model-path build/llama3-8b-dummy --out build/adapter-8b [--rank 16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang_pic.model_loader.span_adapter import SpanAdapter, save_adapter


def random_adapter(model_path: Path, rank: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32
                   ) -> SpanAdapter:
    """Factors drawn N(0, 0.1) for every decoder linear of the Llama-family model at `model_path`, alpha 2 x rank."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(seed)
    factors = {f"model.layers.{i}.{name}": ((torch.randn(rank, n_in, generator=gen) * 0.1).to(dtype),
                                           (torch.randn(n_out, rank, generator=gen) * 0.1).to(dtype))
               for i in range(config["num_hidden_layers"]) for name, (n_out, n_in) in shapes.items()}
    return SpanAdapter(rank, 2.0 * rank, factors, {"training": {"data": "random factors (benchmark/make_adapter.py)"}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    save_adapter(args.out, random_adapter(args.model_path, args.rank, args.seed, torch.bfloat16), str(args.model_path))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
