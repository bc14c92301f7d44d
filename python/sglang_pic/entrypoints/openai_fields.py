"""The request fields shared by /v1/completions and /v1/chat/completions: the strict base every request model
builds on (unknown fields and wrong JSON types rejected, never coerced) and the sampling fields, SGLang's
extensions among them. Fields of OpenAI's API or SGLang's that have no effect here are accepted at neutral values
from each model's `ignored_fields` table (sglang_fields)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from sglang_pic.sampling.sampling_params import check_at_least
from sglang_pic.sglang_fields import OPENAI_FIELDS, Ignored, accept_fields
from sglang_pic.span_policy import SETTING_FIELDS

MAX_TOP_LOGPROBS = 20


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Sampling fields shared by completions and chat, including SGLang's extensions."""

    # The fields this request type takes at neutral values only, beyond those it defines.
    ignored_fields: ClassVar[Mapping[str, Ignored]] = OPENAI_FIELDS
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI bookkeeping a client may send along (SDK agents do); accepted, nothing to do here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # SGLang extensions.
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    stop_regex: str | list[str] | None = None
    priority: int | None = None  # with --enable-priority-scheduling
    data_parallel_rank: int | None = None  # the replica to run on (a server with dp_size > 1)
    # sglang_pic extension: this request's span quality settings (span_policy.py); None: the server's.
    span_anchor: str | None = None
    span_head_tokens: int | None = None
    span_tail_tokens: int | None = None
    span_query_share: float | None = None
    span_select: str | None = None
    span_attention_temperature: float | None = None
    span_attention_scale: float | None = None

    def span_settings(self) -> dict[str, Any]:
        """This request's span quality settings by name (SETTING_FIELDS), for GenerateReqInput."""
        return {name: getattr(self, name) for name in SETTING_FIELDS}

    @model_validator(mode="before")
    @classmethod
    def _ignored_fields(cls, data: Any) -> Any:
        """The fields of `ignored_fields` are accepted at their neutral values; every unsupported or unknown field
        is named at once."""
        if not isinstance(data, dict):
            return data
        return accept_fields(data, cls.model_fields, cls.ignored_fields)

    @field_validator("n", "max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _at_least_one(cls, v: int | None, info: ValidationInfo) -> int | None:
        """Counts of choices and tokens: an OpenAI route generates at least one token (native /generate takes 0,
        prefill only)."""
        return v if v is None else check_at_least(info.field_name, v, 1)
