"""Constrained outputs through the OpenAI client: a JSON-schema reply, a forced tool call, a regex completion.

    python -m sglang_pic.launch_server --port 30000 --context-length 2048
    python examples/constrained_outputs.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import openai

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--url", default="http://127.0.0.1:30000")
client = openai.OpenAI(base_url=p.parse_args().url + "/v1", api_key="unused")
schema = {"type": "object", "properties": {"city": {"type": "string"}, "population_millions": {"type": "number"},
          "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["city", "population_millions", "landmarks"], "additionalProperties": False}
fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
r = client.chat.completions.create(
    model="default", messages=[{"role": "user", "content": "Describe Paris briefly."}], temperature=0, max_tokens=96,
    response_format=fmt,
)
print("response_format json_schema:", r.choices[0].finish_reason, r.choices[0].message.content)
print("  parses:", json.loads(r.choices[0].message.content))
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search_docs", "description": "Search documentation.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
r = client.chat.completions.create(
    model="default", messages=[{"role": "user", "content": "How do I open a file in Python?"}], tools=tools,
    tool_choice={"type": "function", "function": {"name": "search_docs"}}, temperature=0, max_tokens=64,
)
calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
print("tool_choice search_docs:", r.choices[0].finish_reason, calls)
colour = "(red|yellow|blue)"
c = client.completions.create(
    model="default", prompt="The three primary colours are", max_tokens=16, temperature=0,
    extra_body={"regex": rf" {colour}, {colour} and {colour}\."},
)
print("completions regex:", repr(c.choices[0].text))
