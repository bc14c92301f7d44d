"""The request fields shared by /v1/completions and /v1/chat/completions: the strict base every request model
builds on (unknown fields and wrong JSON types rejected, never coerced) and the sampling fields, SGLang's
extensions among them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from sglang_pic.sglang_fields import OPENAI_FIELDS, accept_fields

MAX_TOP_LOGPROBS = 20


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Sampling fields shared by completions and chat, including SGLang's extensions."""

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

    @model_validator(mode="before")
    @classmethod
    def _sglang_extensions(cls, data: Any) -> Any:
        """SGLang's other extensions are accepted at their neutral values (sglang_fields); every unsupported or
        unknown field is named at once."""
        if not isinstance(data, dict):
            return data
        return accept_fields(data, cls.model_fields, OPENAI_FIELDS)

    @field_validator("n")
    @classmethod
    def _n_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("n must be at least 1")
        return v
