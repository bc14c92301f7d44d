"""Qwen2: the Llama decoder with biased q/k/v projections (o_proj has none)."""

from __future__ import annotations

from sglang_pic.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
