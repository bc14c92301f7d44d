"""Request fields that this engine does not act on, and the values at which leaving them out changes nothing.

SGLang's clients (its bench_serving, sglang-router, RL trainers) send the fields of SGLang's request types
(sglang 0.5.9's and main's), mostly at their defaults: `"lora_path": null, "return_routed_experts": false`; OpenAI's
SDKs and agent frameworks send the fields of OpenAI's API (`prompt_cache_key`, `safety_identifier`, `verbosity`).
Such a field is accepted at a neutral value and dropped; any other value asks for something this engine lacks and
is refused with the field's name. A name that neither the request type, SGLang nor OpenAI defines is refused too,
so typos still surface. The tables sit at the bottom layer because sampling parameters use them as well as the API
types.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ignored:
    """`neutral`: the values at which the field changes nothing here; None: every value does (the field only
    concerns logging, tracing, metrics or routing). `feature`: what another value asks for."""

    neutral: tuple[Any, ...] | None
    feature: str = ""

    def accepts(self, value: Any) -> bool:
        if self.neutral is None:
            return True
        # Exact types: `0` is not `false`, so a client bug is not taken for the neutral value.
        if any(type(value) is type(n) and value == n for n in self.neutral):
            return True
        # Else a list may hold one value per prompt of a batch.
        return isinstance(value, list) and all(self.accepts(v) for v in value)

    def hint(self) -> str:
        values = " or ".join(json.dumps(n) for n in self.neutral or ())
        return f"send {values} or leave it out"


class RefusedFields(ValueError):
    """Fields refused by name: `names` lists them (the unsupported ones first), for OpenAI's error `param`."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


def _off(feature: str, *neutral: Any) -> Ignored:
    return Ignored(neutral or (None,), feature)


_ANY = Ignored(None)
_MULTIMODAL = "multimodal input"
_DISAGGREGATION = "prefill/decode disaggregation"

# /generate: GenerateReqInput's fields that GenerateReqInput here does not define.
GENERATE_FIELDS: dict[str, Ignored] = {
    # Bookkeeping: logging, tracing, metrics, routing hints and SGLang's internal timings.
    "model": _ANY,  # not SGLang's field; sglang-router adds it to every request it forwards
    "log_metrics": _ANY,
    "no_logs": _ANY,
    "custom_labels": _ANY,
    "external_trace_header": _ANY,
    "conversation_id": _ANY,
    "routing_key": _ANY,
    "kv_router_hint": _ANY,
    "validation_time": _ANY,
    "received_time": _ANY,
    "received_time_perf": _ANY,
    "http_worker_ipc": _off("multi-tokenizer routing"),
    # Outputs this engine does not produce.
    "return_hidden_states": _off("hidden states", False),
    "return_routed_experts": _off("MoE routed experts", False),
    "routed_experts_start_len": _off("MoE routed experts", 0),
    "return_indexer_topk": _off("indexer top-k", False),
    "return_entropy": _off("entropy", False),
    "return_bytes": _off("bytes output", False),
    "return_prompt_token_ids": _off("prompt token ids in the output", False),
    "return_sampling_mask": _off("sampling masks", None, False),
    "return_flat_raw_top_logprobs": _off("flat top logprobs", False),
    "return_flat_raw_top_logprobs_b64": _off("flat top logprobs", False),
    # Inputs this engine does not take.
    "input_embeds": _off("input embeddings"),
    "positional_embed_overrides": _off("embedding overrides"),
    "image_data": _off(_MULTIMODAL),
    "video_data": _off(_MULTIMODAL),
    "audio_data": _off(_MULTIMODAL),
    "modalities": _off(_MULTIMODAL),
    "mm_hashes": _off(_MULTIMODAL),
    "mm_content_hashes": _off(_MULTIMODAL),
    "use_audio_in_video": _off(_MULTIMODAL, False),
    "video_config": _off(_MULTIMODAL),
    "images_config": _off(_MULTIMODAL),
    "max_dynamic_patch": _off(_MULTIMODAL),
    "min_dynamic_patch": _off(_MULTIMODAL),
    "image_max_dynamic_patch": _off(_MULTIMODAL),
    "video_max_dynamic_patch": _off(_MULTIMODAL),
    "need_wait_for_image": _off(_MULTIMODAL, None, False),
    "need_wait_for_mm_inputs": _off(_MULTIMODAL, None, False),
    "num_items_assigned": _off(_MULTIMODAL),
    "encoder_urls": _off(_MULTIMODAL),
    "multi_item_delimiter_indices": _off("multi-item scoring"),
    # Features this engine does not have.
    "lora_path": _off("LoRA adapters"),
    "lora_id": _off("LoRA adapters"),
    "custom_logit_processor": _off("custom logit processors"),
    "session_params": _off("sessions"),
    "session_id": _off("sessions"),
    "extra_key": _off("cache namespaces"),
    "cache_salt": _off("cache namespaces"),
    "bootstrap_host": _off(_DISAGGREGATION),
    "bootstrap_port": _off(_DISAGGREGATION),
    "bootstrap_room": _off(_DISAGGREGATION),
    "bootstrap_pair_key": _off(_DISAGGREGATION),
    "decode_tp_size": _off(_DISAGGREGATION),
    "disagg_prefill_dp_rank": _off(_DISAGGREGATION),
    "require_reasoning": _off("required reasoning", False),
    "max_thinking_tokens": _off("thinking budgets"),
    "background": _off("background responses", False),
}
# SGLang main's name for data_parallel_rank.
GENERATE_ALIASES = {"routed_dp_rank": "data_parallel_rank"}

# sampling_params: SGLang's SamplingParams keys that SamplingParams here does not define.
SAMPLING_FIELDS: dict[str, Ignored] = {
    "stream_interval": _off("per-request stream intervals; the server's --stream-interval applies"),
}
SAMPLING_ALIASES = {"sampling_seed": "seed"}

# /v1/completions and /v1/chat/completions: SGLang's extensions to OpenAI's requests not defined here.
OPENAI_FIELDS: dict[str, Ignored] = {
    **{
        name: GENERATE_FIELDS[name]
        for name in (
            "return_hidden_states", "return_routed_experts", "lora_path", "session_params", "custom_logit_processor",
            "bootstrap_host", "bootstrap_port", "bootstrap_room", "extra_key", "cache_salt", "custom_labels",
            "max_dynamic_patch", "min_dynamic_patch",
        )
    },
    "custom_params": _ANY,  # only read by a custom logit processor, which is never set
    "return_cached_tokens_details": _off("cached token details", False),
    "response_format": _off("response_format on completions; chat takes it"),
    "reasoning_effort": _off("reasoning effort", "medium", None),
    "stream_reasoning": _off("buffered reasoning", True),
}

# /v1/chat/completions: the fields of OpenAI's chat API that ChatCompletionRequest does not define.
OPENAI_CHAT_API_FIELDS: dict[str, Ignored] = {
    "prompt_cache_key": _ANY,  # the cache is automatic: the radix cache finds shared prefixes and spans by content
    "safety_identifier": _ANY,  # an end-user id for OpenAI's abuse monitoring
    "prompt_cache_retention": _off("extended prompt cache retention", None, "in_memory"),
    "prompt_cache_options": _off("explicit prompt caching", None, {}, {"mode": "implicit"}),
    "verbosity": _off("verbosity control", None, "medium"),
    "modalities": _off("audio output", None, ["text"]),
    "audio": _off("audio output"),
    "prediction": _off("predicted outputs"),
    "web_search_options": _off("web search"),
    "moderation": _off("moderation"),
    "functions": _off("legacy function calling; send tools", None, []),
    "function_call": _off("legacy function calling; send tool_choice", None, "none", "auto"),
}

# /abort_request: AbortReq.
ABORT_FIELDS: dict[str, Ignored] = {
    "finished_reason": _off("a caller-given finish reason"),
    "abort_message": _off("a caller-given abort message"),
    "http_worker_ipc": GENERATE_FIELDS["http_worker_ipc"],
}

# /update_weights_from_disk: UpdateWeightFromDiskReqInput (in-flight requests finish, then the cache is dropped).
UPDATE_WEIGHTS_FIELDS: dict[str, Ignored] = {
    "rid": _ANY,
    "http_worker_ipc": GENERATE_FIELDS["http_worker_ipc"],
    "abort_all_requests": _off("aborting the requests in flight", False),
    "flush_cache": _off("keeping the cache across weights", True),
    "weight_version": _off("weight versions"),
    "is_async": _off("asynchronous weight updates", False),
    "torch_empty_cache": _ANY,
    "keep_pause": _off("pausing generation", False),
    "recapture_cuda_graph": _off("recapturing CUDA graphs", False),
    "token_step": _off("trainer steps", 0),
    "manifest": _off("tensor manifests"),
}

# /start_profile: ProfileReqInput.
START_PROFILE_FIELDS: dict[str, Ignored] = {
    "rid": _ANY,
    "http_worker_ipc": GENERATE_FIELDS["http_worker_ipc"],
    "profile_id": _ANY,
    "start_step": _off("a delayed profile start"),
    "profile_by_stage": _off("profiles by stage", False),
    "profile_stages": _off("profiles by stage"),
    "with_stack": _off("stack traces in profiles", None, False),
    "merge_profiles": _off("merged profiles", False),
    "profile_prefix": _off("trace name prefixes"),
    "shape_discovery": _off("kernel shape discovery", False),
}


def accept_fields(
    body: Mapping[str, Any],
    known: Collection[str],
    ignored: Mapping[str, Ignored],
    aliases: Mapping[str, str] | None = None,
    noun: str = "field",
) -> dict[str, Any]:
    """The fields of `body` named in `known` (aliases resolved), once every other field is one of `ignored` at a
    neutral value; otherwise RefusedFields naming every unsupported and every unknown field."""
    kept: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # the name each kept value came under
    unsupported: dict[str, str] = {}  # name: what its value asks for
    unknown: list[str] = []
    for name, value in body.items():
        target = (aliases or {}).get(name, name)
        if target in known:
            if value is None:  # null means the default, also for an alias
                kept.setdefault(target, None)
                continue
            if kept.get(target) is not None and kept[target] != value:
                raise ValueError(f"{given_as[target]} and {name} disagree; give only one")
            kept[target], given_as[target] = value, name
        elif name in ignored:
            rule = ignored[name]
            if not rule.accepts(value):
                unsupported[name] = f"{name}={_show(value)} ({rule.feature}; {rule.hint()})"
        else:
            unknown.append(name)
    unknown.sort()
    problems = []
    if unsupported:
        problems.append(f"unsupported {noun}{'s' if len(unsupported) > 1 else ''}: {', '.join(unsupported.values())}")
    if unknown:
        problems.append(f"unknown {noun}{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    if problems:
        raise RefusedFields("; ".join(problems), [*unsupported, *unknown])
    return kept


def _show(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
