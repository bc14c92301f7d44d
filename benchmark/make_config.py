"""Write a Llama-3-8B-shaped model folder (config + a real tokenizer, no weights) for --load-format dummy runs.

The GPU benchmarks measure serving cost, which depends on the model's shape, not its weights: with dummy
weights an 8B-class run needs no checkpoint download. The tokenizer is real (by default the embedded Qwen2.5
one), so prompts tokenize like English; vocab_size follows it. RoPE and context follow Llama-3.1-8B (same shape
as Llama-3-8B, 128K positions with llama3 scaling) so the 32K-token span sweep fits.

Usage: python benchmark/make_config.py --out build/llama3-8b-dummy [--tokenizer-path DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

LLAMA3_8B_SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
)
LLAMA31_ROPE = dict(
    rope_theta=500000.0,
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def padded_vocab(num_tokens: int, multiple: int = 128) -> int:
    """The tokenizer's size rounded up, as checkpoints pad their embedding tables for matmul-friendly shapes."""
    return -(-num_tokens // multiple) * multiple


def write_config(
    out: Path, tokenizer_path: str, max_position_embeddings: int, shape: dict | None = None, dtype: str = "bfloat16"
) -> Path:
    """Write the folder; `shape` overrides the Llama-3-8B layer shape (host-overhead benchmarks use a tiny one)."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=padded_vocab(len(tokenizer)),
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(LLAMA31_ROPE),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
        **(LLAMA3_8B_SHAPE if shape is None else {**LLAMA3_8B_SHAPE, **shape}),
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write (config.json, tokenizer files)")
    p.add_argument("--tokenizer-path", help="tokenizer folder; default: the embedded Qwen2.5 model's")
    p.add_argument("--max-position-embeddings", type=int, default=131072)
    args = p.parse_args(argv)
    if args.tokenizer_path is None:
        from sglang_pic.model_loader.default_model import default_model_path

        args.tokenizer_path = default_model_path()
    out = write_config(args.out, args.tokenizer_path, args.max_position_embeddings)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
