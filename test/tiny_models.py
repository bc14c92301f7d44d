"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3, Mistral) with a locally trained tokenizer, for offline tests.

Weights are drawn large enough (std ~0.15, random norms and biases) that logits are O(1), so a comparison against
HF transformers at atol 1e-4 actually tests something. Everything is saved in float32 through `save_pretrained`,
so HF and our loader read the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
VOCAB_SIZE = 384
MAX_POSITIONS = 256
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Once upon a time there was a little town by the sea where fishermen told stories every night.",
    "A serving engine batches requests, caches keys and values, and streams tokens back to each client.",
    "The weather today is sunny with a light breeze, and tomorrow will bring rain from the west.",
    "She opened the old book, read the first chapter aloud, and the children listened quietly.",
    "Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy to learn.",
    "def add(a, b): return a + b  # a tiny Python function that adds two numbers together",
    "The capital of France is Paris, the capital of Japan is Tokyo, and the capital of Italy is Rome.",
    "Please write a short poem about the moon, the stars, and the quiet hours before the dawn.",
    "He said hello to everyone in the room, then sat down and asked what they wanted to eat.",
    "Machine learning models predict the next word from the words that came before it.",
    "In the morning we walked to the market, bought fresh bread and apples, and came home for tea.",
]

_ARCH_SETTINGS: dict[str, dict] = {
    "llama": dict(
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": dict(head_dim=32, rope_theta=1000000.0, num_hidden_layers=3),
    "mistral": dict(head_dim=16, sliding_window=MAX_POSITIONS),
}


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(arch: str, tokenizer, overrides: dict | None = None):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    settings = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(_ARCH_SETTINGS[arch])
    settings.update(overrides or {})
    return cls(**settings)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with std 0.15, norms near 1 and nonzero biases, so every parameter visibly shapes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)


def build_tiny_model(root: Path, arch: str, name: str | None = None, **overrides) -> Path:
    """Write a tiny `arch` checkpoint with tokenizer and generation config to root/<name or arch>; return that
    folder. `overrides` change config fields (e.g. num_key_value_heads=1)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    out = Path(root) / (name or arch)
    tokenizer = _train_tokenizer()
    config = _hf_config(arch, tokenizer, overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=ARCHS.index(arch))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
