"""End-to-end engine throughput on a Llama-3-8B-shaped model with dummy weights, next to HF transformers.

Prefill: tokens/s for prompts of 1K-8K tokens (radix cache off, one new token each). Decode: tokens/s at batch
sizes 1, 32 and 128 (prompts of --decode-prompt-len tokens, --decode-steps new tokens; the prefill time, measured
separately, is subtracted). HF runs the same weights (copied into our model) with `generate` on the same GPU.

  python benchmark/bench_engine_e2e.py --out benchmark/results/engine_e2e_h200.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TINY = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096}


def write_config(cfg: dict) -> str:
    folder = Path(tempfile.mkdtemp(prefix="bench_cfg_"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_ours(engine, args, vocab: int) -> dict:
    out: dict = {"prefill": [], "decode": []}
    one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=rand_prompts(2, 256, vocab, 0), sampling_params=one)  # warm-up (JIT, graphs)
    for length in args.prefill_lens:
        n = max(1, args.prefill_tokens // length)
        prompts = rand_prompts(n, length, vocab, length)
        secs = timed(lambda: engine.generate(input_ids=prompts, sampling_params=one))
        flops = n * (2 * engine_params(engine) * length + attn_flops(engine, length))
        out["prefill"].append(
            {"prompt_len": length, "num_prompts": n, "seconds": secs, "tokens_per_s": n * length / secs,
             "tflops": flops / secs / 1e12}
        )
        print(f"ours prefill L={length}: {n * length / secs:,.0f} tok/s, {flops / secs / 1e12:.0f} TFLOP/s", flush=True)
    overlaps = (False, True) if args.overlap_ab else (engine.scheduler.overlap,)
    for bs in args.decode_batches:
        prompts = rand_prompts(bs, args.decode_prompt_len, vocab, 1000 + bs)
        t_prefill = timed(lambda: engine.generate(input_ids=prompts, sampling_params=one))
        many = {"max_new_tokens": args.decode_steps + 1, "temperature": 0, "ignore_eos": True}
        for overlap in overlaps:
            engine.scheduler.overlap = overlap
            t_total = timed(lambda: engine.generate(input_ids=prompts, sampling_params=many))
            secs = t_total - t_prefill
            out["decode"].append(
                {"batch": bs, "prompt_len": args.decode_prompt_len, "steps": args.decode_steps, "seconds": secs,
                 "tokens_per_s": bs * args.decode_steps / secs, "overlap_schedule": overlap}
            )
            print(f"ours decode bs={bs} overlap={'on' if overlap else 'off'}: {bs * args.decode_steps / secs:,.0f} "
                  "tok/s", flush=True)
    return out


def engine_params(engine) -> int:
    """Weights every prefill token multiplies through: not the embedding, nor the LM head (prefill computes logits
    only for each request's last token)."""
    skip = ("embed_tokens", "lm_head")
    return sum(p.numel() for n, p in engine.runner.model.named_parameters() if not any(s in n for s in skip))


def attn_flops(engine, length: int) -> float:
    cfg = engine.model_config
    # causal QK^T and PV: 2 matmuls x 2 flops x (L^2 / 2) x heads x head_dim, per layer
    return 2 * 2 * (length * length / 2) * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers


def bench_hf(model, args, vocab: int, device: str) -> dict:
    out: dict = {"prefill": [], "decode": []}
    with torch.inference_mode():
        model(torch.tensor(rand_prompts(1, 128, vocab, 0), device=device))
        for length in args.prefill_lens:
            n = max(1, args.prefill_tokens // length)
            prompts = rand_prompts(n, length, vocab, length)

            def run() -> None:
                for p in prompts:
                    model(torch.tensor([p], device=device), logits_to_keep=1)

            secs = timed(run)
            out["prefill"].append({"prompt_len": length, "num_prompts": n, "seconds": secs,
                                   "tokens_per_s": n * length / secs})
            print(f"hf prefill L={length}: {n * length / secs:,.0f} tok/s", flush=True)
        for bs in args.decode_batches:
            ids = torch.tensor(rand_prompts(bs, args.decode_prompt_len, vocab, 1000 + bs), device=device)

            def gen(n: int) -> None:
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)

            t_prefill = timed(lambda: gen(1))
            t_total = timed(lambda: gen(args.decode_steps + 1))
            secs = t_total - t_prefill
            out["decode"].append({"batch": bs, "prompt_len": args.decode_prompt_len, "steps": args.decode_steps,
                                  "seconds": secs, "tokens_per_s": bs * args.decode_steps / secs})
            print(f"hf decode bs={bs}: {bs * args.decode_steps / secs:,.0f} tok/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="config folder (default: a Llama-3-8B-shaped config)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192])
    ap.add_argument("--prefill-tokens", type=int, default=32768, help="tokens per prefill measurement")
    ap.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--rotate-keys-in-kernel",
        action="store_true",
        help="A/B of key staging: a staging bound of 0 makes every extend rotate keys inside the attention kernel",
    )
    ap.add_argument(
        "--overlap-ab",
        action="store_true",
        help="measure each decode batch twice on the same engine: overlap scheduling off, then on",
    )
    ap.add_argument("--attention-backend", help="the engine's --attention-backend (default: its default)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (e.g. fp8_e4m3)")
    ap.add_argument("--quantization",
                    help="the engine's --quantization (fp8: weights and GEMMs in float8); needs --no-hf")
    ap.add_argument("--span-adapter", help="the engine's --span-adapter, served apart: the prompts here are dense, so "
                    "this measures what a loaded adapter costs requests that keep no span")
    ap.add_argument("--quick", action="store_true", help="tiny model, tiny sizes (CPU smoke run)")
    ap.add_argument("--out", default="benchmark/results/engine_e2e.json")
    args = ap.parse_args()
    if args.quantization and not args.no_hf:
        ap.error("--quantization needs --no-hf: HF generate runs the unquantized weights")
    from sglang_pic import Engine
    from sglang_pic.kernels import stage_keys

    if args.rotate_keys_in_kernel:
        stage_keys.STAGE_MAX_BYTES = 0

    cfg = TINY if args.quick else LLAMA3_8B
    if args.quick:
        args.prefill_lens, args.prefill_tokens, args.decode_batches = [64, 128], 256, [1, 4]
        args.decode_prompt_len, args.decode_steps = 32, 8
    path = args.model_path or write_config(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if device == "cuda" else "float32"
    engine = Engine(model_path=path, load_format="dummy", dtype=dtype, skip_tokenizer_init=True,
                    disable_radix_cache=True, mem_fraction_static=0.6, chunked_prefill_size=8192,
                    max_total_tokens=None if device == "cuda" else 8192, schedule_policy="fcfs",
                    attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                    quantization=args.quantization, span_adapter=args.span_adapter)
    vocab = engine.model_config.vocab_size
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": dtype,
              "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
              "span_adapter": args.span_adapter,
              "config": path if args.model_path else ("tiny" if args.quick else "llama3-8b"),
              "ours": bench_ours(engine, args, vocab)}
    if not args.no_hf:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_cfg = AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, dtype)).eval()
        engine.runner.model.load_weights(model.state_dict().items())  # identical weights on both sides
        result["hf"] = bench_hf(model, args, vocab, device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
