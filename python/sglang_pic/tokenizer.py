"""Load the HF tokenizer of a model folder (chat template included)."""

from __future__ import annotations


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
