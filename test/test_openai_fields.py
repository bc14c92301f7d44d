"""OpenAI's request fields and the context limit, without a server.

Every field the installed `openai` SDK defines for a chat or completions request is a field of our request model
or listed with its neutral values (sglang_fields), so an SDK release that adds a field fails here by name; neutral
values pass, others and unknown names are refused with the field as OpenAI's `param`. Bounds read
`<field> must be at least N, got V` on every route. A prompt whose explicit output limit runs past the context is
refused with the numbers, in the tokens the scheduler will place; a default limit is cut to the room left instead.
"""

from __future__ import annotations

import importlib
import json
import re

import pytest
from pydantic import ValidationError

from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, describe_errors
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.req import Req
from sglang_pic.managers.request_builder import ContextOverflow, RequestBuilder
from sglang_pic.model_config import ModelConfig
from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.server_args import ServerArgs
from sglang_pic.sglang_fields import OPENAI_CHAT_API_FIELDS
from sglang_pic.tokenizer import load_tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}]
# The SDK's request types: the module and the prefix of its TypedDicts (Base, Streaming, NonStreaming).
SDK_REQUESTS = {
    "chat": ("openai.types.chat.completion_create_params", "CompletionCreateParams", ChatCompletionRequest),
    "completions": ("openai.types.completion_create_params", "CompletionCreateParams", CompletionRequest),
}
CONTEXT = 256  # the tiny models' context


def sdk_fields(module_name: str, prefix: str) -> set[str]:
    """Every key of the SDK's request TypedDicts, `stream` (only in the streaming variants) included."""
    module = importlib.import_module(module_name)
    types = [getattr(module, prefix + kind) for kind in ("Base", "Streaming", "NonStreaming")]
    return {key for t in types for key in t.__required_keys__ | t.__optional_keys__}


def refusal(model: type, body: dict) -> tuple[str, str | None]:
    """The 400's message and `param` for a body the model refuses."""
    with pytest.raises(ValidationError) as err:
        model.model_validate_json(json.dumps(body))
    return describe_errors(err.value.errors())


def base_body(route: str) -> dict:
    return {"messages": MESSAGES} if route == "chat" else {"prompt": "Hi"}


@pytest.mark.parametrize("route", SDK_REQUESTS)
def test_every_sdk_field_is_served_or_ignored(route):
    module_name, prefix, model = SDK_REQUESTS[route]
    sdk = sdk_fields(module_name, prefix)
    assert {"model", "stream", "max_tokens", "n"} <= sdk  # the SDK's types were read
    missing = sorted(sdk - set(model.model_fields) - set(model.ignored_fields))
    assert not missing, f"fields of openai's {route} request neither served nor ignored: {missing}"


def test_ignored_chat_fields_are_the_sdks():
    """The table names only fields the SDK defines and the model does not."""
    sdk = sdk_fields(*SDK_REQUESTS["chat"][:2])
    assert set(OPENAI_CHAT_API_FIELDS) <= sdk - set(ChatCompletionRequest.model_fields)


@pytest.mark.parametrize(
    "name,value",
    [(name, value) for name, rule in OPENAI_CHAT_API_FIELDS.items() for value in (rule.neutral or ("any",))],
)
def test_neutral_values_are_accepted(name, value):
    assert ChatCompletionRequest.model_validate_json(json.dumps({"messages": MESSAGES, name: value}))


def test_agent_framework_body_is_accepted():
    """What current SDKs and agent frameworks send along, which was `400 unknown field`."""
    body = {"messages": MESSAGES, "prompt_cache_key": "session-7", "safety_identifier": "user-42",
            "verbosity": "medium", "modalities": ["text"], "prompt_cache_retention": "in_memory"}
    assert ChatCompletionRequest.model_validate_json(json.dumps(body)).messages[0].content == "Hi"


@pytest.mark.parametrize(
    "name,value",
    [("verbosity", "high"), ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "mp3"}),
     ("prompt_cache_retention", "24h"), ("web_search_options", {}), ("functions", [{"name": "f"}])],
)
def test_values_asking_for_more_are_refused_by_name(name, value):
    message, param = refusal(ChatCompletionRequest, {"messages": MESSAGES, name: value})
    assert message.startswith(f"unsupported field: {name}=") and param == name


@pytest.mark.parametrize("route", SDK_REQUESTS)
def test_unknown_fields_are_refused_by_name(route):
    message, param = refusal(SDK_REQUESTS[route][2], {**base_body(route), "prompt_cache_kye": "k", "verbosty": 1})
    assert message == "unknown fields: prompt_cache_kye, verbosty" and param == "prompt_cache_kye"
    message, param = refusal(SDK_REQUESTS[route][2], {**base_body(route), "lora_path": "a", "zzz": 1})
    assert param == "lora_path" and message.endswith("; unknown field: zzz")


BOUND = re.compile(r"^(\w+) must be at least (-?\d+), got (-?\d+)$")


@pytest.mark.parametrize(
    "route,field,value,minimum",
    [("completions", "max_tokens", 0, 1), ("completions", "max_tokens", -5, 1), ("completions", "n", 0, 1),
     ("chat", "max_tokens", -5, 1), ("chat", "max_completion_tokens", 0, 1), ("chat", "n", -1, 1)],
)
def test_openai_bounds_read_alike(route, field, value, minimum):
    message, param = refusal(SDK_REQUESTS[route][2], {**base_body(route), field: value})
    assert BOUND.match(message).groups() == (field, str(minimum), str(value)) and param == field


def test_native_bounds_read_alike():
    for params, expected in (({"max_new_tokens": -5}, ("max_new_tokens", "0", "-5")), ({"n": 0}, ("n", "1", "0"))):
        with pytest.raises(ValueError) as err:
            SamplingParams.from_dict(params)
        assert BOUND.match(str(err.value)).groups() == expected
    message, param = refusal(ChatCompletionRequest, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21})
    assert (message, param) == ("top_logprobs must be in [0, 20], got 21", "top_logprobs")
    message, _ = refusal(CompletionRequest, {"prompt": "Hi", "logprobs": -1})
    assert message == "logprobs must be in [0, 20], got -1"


@pytest.fixture(scope="module")
def builder(tiny_llama) -> RequestBuilder:
    args = ServerArgs.from_kwargs(model_path=str(tiny_llama))
    config = ModelConfig.from_path(str(tiny_llama), device="cpu")
    assert config.context_len == CONTEXT
    return RequestBuilder(args, load_tokenizer(str(tiny_llama)), config)


def build(builder: RequestBuilder, prompt_len: int, default: int | None = None, **sampling) -> list:
    return builder.build(GenerateReqInput(input_ids=[5] * prompt_len, sampling_params=sampling), default)


def test_explicit_limit_past_the_context_is_refused_with_the_numbers(builder):
    with pytest.raises(ContextOverflow) as err:
        build(builder, 250, max_new_tokens=100)
    assert str(err.value) == (
        "This model's maximum context length is 256 tokens. However, you requested 350 tokens (250 in the prompt, "
        "100 for the completion). Reduce the prompt or max_new_tokens."
    )
    assert err.value.message("max_completion_tokens").endswith("Reduce the prompt or max_completion_tokens.")
    assert build(builder, 250, max_new_tokens=6)[0].sampling_params.max_new_tokens == 6  # exactly fills it


def test_default_limit_is_cut_to_the_room_left(builder):
    assert build(builder, 250)[0].sampling_params.max_new_tokens == 6  # SamplingParams' 128, cut
    assert build(builder, 10)[0].sampling_params.max_new_tokens == 128
    assert build(builder, 10, default=16)[0].sampling_params.max_new_tokens == 16  # a route's own default
    assert build(builder, 10, default=CONTEXT)[0].sampling_params.max_new_tokens == CONTEXT - 10


@pytest.mark.parametrize("sampling", [{}, {"max_new_tokens": 0}, {"max_new_tokens": 4}])
def test_prompt_that_fills_the_context_is_refused(builder, sampling):
    with pytest.raises(ContextOverflow) as err:
        build(builder, CONTEXT, **sampling)
    assert str(err.value) == (
        "This model's maximum context length is 256 tokens. However, the prompt has 256 tokens, which leaves no "
        "room for the completion. Reduce the prompt."
    )


def test_batch_names_the_prompt(builder):
    obj = GenerateReqInput(input_ids=[[5] * 10, [5] * 250], sampling_params={"max_new_tokens": 10})
    with pytest.raises(ContextOverflow, match=r"^request 1: This model's maximum context length is 256 tokens\."):
        builder.build(obj)


def test_marked_prompt_counts_the_positions_the_scheduler_places(builder):
    """Markers take no position; spans and their heads do: the limit counts what the scheduler's row holds."""
    doc = "The capital of France is Paris, the capital of Japan is Tokyo. " * 3
    text = f"System. <|ssep|>{doc}<|ssep|>{doc}<|pdep|>Question?"
    req = builder.build(GenerateReqInput(text=text, sampling_params={"max_new_tokens": 1}))[0]
    counted = sum(len(seg.token_ids) for seg in builder.tokenize(text))
    assert req.prompt_len == counted == Req.from_wire(req).seq_len()
    with pytest.raises(ContextOverflow, match=rf"\({counted} in the prompt, {CONTEXT - counted + 1} for the"):
        builder.build(GenerateReqInput(text=text, sampling_params={"max_new_tokens": CONTEXT - counted + 1}))
    fits = builder.build(GenerateReqInput(text=text, sampling_params={"max_new_tokens": CONTEXT - counted}))
    assert fits[0].sampling_params.max_new_tokens == CONTEXT - counted
