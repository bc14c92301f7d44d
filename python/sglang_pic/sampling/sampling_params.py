"""Per-request sampling parameters, named and defaulted as in SGLang, checked at the door so bad requests fail early.

Every check raises ValueError with the offending field's name in the message, so the HTTP layer can return it as a
400 unchanged; a bound reads the same on every route (`check_at_least`, `check_range`, shared with the OpenAI
request models). Checks that need the model's vocabulary size wait for `verify`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any, Callable

from sglang_pic.sampling.stop_conditions import StopConditions, StopTokenizer, check_stop_regex
from sglang_pic.sglang_fields import SAMPLING_ALIASES, SAMPLING_FIELDS, accept_fields

# Below this a temperature is treated as zero, i.e. greedy decoding (as in SGLang).
SAMPLING_EPS = 1e-6

# Constrained decoding: a request may set one of these (compiled and applied by sampling/grammar.py).
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # Added to the logits of the given token ids; JSON's string keys are turned into ints.
    logit_bias: dict[int, float] | None = None
    # SGLang hands these to a custom logit processor; none is ever loaded here, so they have no effect (as in
    # SGLang when a request names no processor).
    custom_params: dict[str, Any] | None = None
    # Constrained decoding (sampling/grammar.py): at most one of these.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # Python regular expressions that end the output where they first match (like stop strings).
    stop_regex: str | list[str] | None = None
    # Filled by normalize(): the stop strings and regexes compiled for searching the output (None: there are none).
    stops: StopConditions | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON object. A null value means the default, as in SGLang; SGLang's keys that have
        no effect here are accepted at their neutral values (sglang_fields)."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        d = accept_fields(d, _INIT_FIELDS, SAMPLING_FIELDS, SAMPLING_ALIASES, noun="sampling parameter")
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first (penalties, logit bias, a min_new_tokens ban): the
        next token is the raw argmax, so the sampler's per-request tensors can be skipped."""
        return (
            self.is_greedy
            and self.min_new_tokens == 0
            and not self.logit_bias
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
            and self.repetition_penalty == 1.0
        )

    def verify(self, vocab_size: int) -> None:
        """Re-run every check (fields may have been set after construction) plus those needing the vocabulary."""
        self._validate()
        bad = [t for t in self.stop_token_ids or [] if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad}")
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {bad}")

    def grammar(self) -> tuple[str, str] | None:
        """(field, source) of the output's grammar, if the request constrains it."""
        return next(((name, getattr(self, name)) for name in GRAMMAR_FIELDS if getattr(self, name)), None)

    def normalize(self, tokenizer: StopTokenizer | None = None) -> None:
        """Turn `stop` and `stop_regex` into lists and compile them for the output search."""
        self.stop = _as_list(self.stop)
        self.stop_regex = _as_list(self.stop_regex)
        self.stops = StopConditions.build(self.stop, self.stop_regex, tokenizer)

    def _validate(self) -> None:
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name)]
        for name in grammars:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if len(grammars) > 1:
            raise ValueError(f"at most one of {', '.join(GRAMMAR_FIELDS)} may be set, got {', '.join(grammars)}")

        self.max_new_tokens = _int("max_new_tokens", self.max_new_tokens)
        self.min_new_tokens = _int("min_new_tokens", self.min_new_tokens)
        self.top_k = _int("top_k", self.top_k)
        self.n = _int("n", self.n)
        self.temperature = _float("temperature", self.temperature)
        self.top_p = _float("top_p", self.top_p)
        self.min_p = _float("min_p", self.min_p)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        self.stop = _stops("stop", self.stop, _check_stop)
        self.stop_regex = _stops("stop_regex", self.stop_regex, check_stop_regex)
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError(f"custom_params must be an object, got {self.custom_params!r}")

        check_at_least("max_new_tokens", self.max_new_tokens, 0)  # 0: prefill only
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        check_at_least("n", self.n, 1)


_INIT_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)


def check_at_least(name: str, value: int, minimum: int) -> int:
    """`value`, or the one refusal every route gives a count below its field's minimum."""
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_range(name: str, value: int, low: int, high: int) -> int:
    """`value`, or the one refusal every route gives a count outside its field's range."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _int(name: str, value: Any) -> int:
    # bool is an Integral in Python, but `"max_new_tokens": true` is a client bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_stop(stop: str) -> None:
    if stop == "":
        raise ValueError("stop strings must be non-empty")


def _stops(name: str, value: Any, check: Callable[[str], None]) -> str | list[str] | None:
    """A string or a list of strings, each passing `check`."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    for item in items:
        check(item)
    return value if isinstance(value, str) else list(value)


def _as_list(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else value


def _token_ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple, set, frozenset)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
    out = [_int("stop_token_ids", t) for t in ids]
    if any(t < 0 for t in out):
        raise ValueError(f"stop_token_ids must be non-negative, got {out}")
    return out


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        token = _int("logit_bias key", token)
        if token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        value = _float(f"logit_bias[{key!r}]", value)
        if not math.isfinite(value):
            raise ValueError(f"logit_bias[{key!r}] must be finite, got {value}")
        out[token] = value
    return out
