"""Load the HF tokenizer of a model folder (chat template included), and decode token ids cheaply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def fast_decode(tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, calling the Rust tokenizer directly where transformers would add nothing to it.

    Streaming decodes every running request's output each step, and for short outputs transformers spends most of
    a decode converting and type-checking the id list in Python. For its tokenizers-backed classes without
    clean-up, the Rust decode is the whole result (they ignore spaces_between_special_tokens too); any other
    tokenizer keeps its own decode.
    """
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    if not plain:
        return tokenizer.decode
    backend = tokenizer._tokenizer

    def decode(ids: list[int], skip_special_tokens: bool = False, **_ignored: Any) -> str:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    return decode
