"""tool_selection: several tool schemas and a request that one of them fits; right = that tool, called with JSON
arguments holding its required keys. Each tool becomes a span through the chat template, as `tool_spans: true`
makes them on the server."""

from __future__ import annotations

import random

from sglang_pic.span_quality.items import CountTokens, Item, ToolGold
from sglang_pic.span_quality.pools import TOOL_SPECS, VALUES, ToolSpec
from sglang_pic.span_quality.sizes import TaskSizes

TOOL_SYSTEM = "You are a helpful assistant. When one of the tools fits the request, call it."


def tool_schema(spec: ToolSpec) -> dict:
    """The OpenAI `tools` entry of a spec."""
    properties = {k: {"type": t, "description": d} for k, (t, d, _) in spec.params.items()}
    return {"type": "function", "function": {
        "name": spec.name, "description": spec.description,
        "parameters": {"type": "object", "properties": properties, "required": list(spec.required)},
    }}


def tool_selection(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    items = []
    for _ in range(samples):
        chosen = rng.sample(TOOL_SPECS, sizes.num_tools)
        target = rng.choice(chosen)
        slots = {k: rng.choice(VALUES[source]) for k, (_, _, source) in target.params.items()}
        tools = tuple(tool_schema(s) for s in chosen)
        items.append(Item(TOOL_SYSTEM, target.request.format(**slots), ToolGold(target.name, target.required), tools))
    return items
