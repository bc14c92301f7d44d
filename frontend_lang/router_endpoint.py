"""SGLang's RuntimeEndpoint for servers behind sglang-router: batched `/generate` bodies go out one prompt each.

sglang-router (0.3) refuses a `/generate` whose `text` is a list (HTTP 422), and SGLang's `select` scores its
choices in exactly such a batch. `RouterEndpoint(router_url)` splits every batched body into single requests and
returns their outputs as the list a batched call would; each choice then takes the router's cache-aware path
like any request (they share the prompt, so they land where it is cached).
"""

from __future__ import annotations

from typing import Any

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

# Fields that hold one value per prompt when a /generate body is batched.
PER_PROMPT_FIELDS = (
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"
)


def batch_size(body: dict[str, Any]) -> int | None:
    """Number of prompts in a batched body; None for a single prompt."""
    if isinstance(body.get("text"), list):
        return len(body["text"])
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def split_batch(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The single-prompt bodies of a batched body of `n` prompts (shared fields copied into each)."""
    items = []
    for i in range(n):
        per_prompt = {k for k, v in body.items() if k in PER_PROMPT_FIELDS and isinstance(v, list)}
        items.append({k: v[i] if k in per_prompt else v for k, v in body.items()})
    return items


class RouterEndpoint(RuntimeEndpoint):
    def _generate_http_request(self, s, data: dict[str, Any]) -> Any:
        send = super()._generate_http_request
        n = batch_size(data)
        return send(s, data) if n is None else [send(s, item) for item in split_batch(data, n)]
