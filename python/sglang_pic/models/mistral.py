"""Mistral: Llama-shaped; its sliding window is refused by `check_config` unless it covers the whole context."""

from __future__ import annotations

from sglang_pic.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
