"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before attention (and thus before RoPE)."""

from __future__ import annotations

from sglang_pic.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
