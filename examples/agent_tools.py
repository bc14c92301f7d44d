"""An agent loop through the OpenAI client: the model calls a tool, the tool's result goes back, the model answers.
Tool descriptions are sent as spans (`tool_spans`), so each is prefilled once and reused whatever tools the next
call lists, in any order.

    python -m sglang_pic.launch_server --port 30000 --context-length 2048
    python examples/agent_tools.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import openai


def function(name: str, description: str, **properties: str) -> dict:
    schema = {k: {"type": v} for k, v in properties.items()}
    params = {"type": "object", "properties": schema, "required": [*properties]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS = [
    function("get_weather", "Get the current weather in a city.", city="string"),
    function("search_docs", "Search the documentation for a query.", query="string"),
]


def run_tool(name: str, arguments: dict) -> dict:
    """Stand-ins for real tools."""
    if name == "get_weather":
        return {"city": arguments["city"], "temp_c": 21, "sky": "sunny"}
    return {"hits": [f"Page about {arguments['query']}"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    for turn in range(3):
        # Reversed on every turn: as spans, the descriptions stay cached in any order.
        tools = TOOLS if turn % 2 == 0 else TOOLS[::-1]
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=tools, temperature=0, max_tokens=64,
            extra_body={"tool_spans": True},
        )
        choice = reply.choices[0]
        usage = reply.usage
        print(f"turn {turn}: {choice.finish_reason}, prompt {usage.prompt_tokens} tokens, "
              f"{usage.prompt_tokens_details.cached_tokens} cached")
        messages.append(choice.message)  # sent back as it came
        if choice.finish_reason != "tool_calls":
            print("answer:", choice.message.content)
            return
        for call in choice.message.tool_calls:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})


if __name__ == "__main__":
    main()
