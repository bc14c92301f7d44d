"""An agent loop through the plain OpenAI client whose tool list changes between questions, as agent frameworks do
when they enable, disable or reorder tools. For each question the model calls a tool, the loop runs it (stand-ins
below) and sends its result back as a `tool` message with the call's id, and the model answers in a sentence. The
requests carry nothing specific to this server; the reuse comes from its flag `--tool-spans on`, which makes every
tool description a span: prefilled once, then read from the cache at whatever place the next request lists it.
Each request prints `usage.prompt_tokens_details.cached_tokens`.

    python -m sglang_pic.launch_server --port 30000 --tool-spans on
    python examples/agent_tools.py --url http://127.0.0.1:30000

On the embedded Qwen2.5-Coder-0.5B and an otherwise idle 2-core CPU it takes about 30 s against a freshly started
server (32 s measured; 3 min 49 s while another job used the cores): four requests, the two that offer tools about
1,100 prompt tokens each.

With the default span settings a request recomputes each description's first 128 tokens itself, so the
descriptions below are longer than that. Without `--tool-spans on` (the default today), a reordered or shortened
list is reused only up to its first change, and the conversation after the tools is never reused once they change.
"""

from __future__ import annotations

import argparse
import json

import openai
from openai.types.chat import ChatCompletionMessage


def function(name: str, description: str, required: list[str], **properties: tuple[str, str]) -> dict:
    schema = {key: {"type": kind, "description": doc} for key, (kind, doc) in properties.items()}
    params = {"type": "object", "properties": schema, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


WEATHER = function(
    "get_weather",
    "Get the current weather and today's forecast for a city. Use it whenever the user asks about temperature, "
    "rain, wind, sky or what to wear outside, now or later today; do not guess the weather from general knowledge. "
    "The tool asks a public weather service for the station closest to the city centre and returns an object with "
    "the temperature in degrees Celsius, the sky (sunny, cloudy, rain, snow, fog or storm), the wind speed in "
    "kilometres per hour and the chance of rain over the next twelve hours as a percentage. Readings are at most "
    "ten minutes old. City names may be given in English or in the local language; when several cities share a "
    "name, add the country after a comma, as in 'Paris, France' or 'Paris, Texas'. If the city is unknown the tool "
    "returns an error object with a message, which should be passed on to the user rather than retried. The "
    "service allows sixty calls a minute per account, which is far more than one conversation needs, so there is "
    "no reason to cache answers between turns.",
    ["city"],
    city=("string", "the city, optionally followed by a comma and its country"),
    units=("string", "metric (the default) or imperial"),
)
CALENDAR = function(
    "create_event",
    "Create an event in the user's calendar. Use it when the user asks to book, schedule, plan or add a meeting, "
    "an appointment, a reminder or any other event at a given date and time; to look at existing events use a "
    "search tool instead. The event is created in the user's default calendar and the user's own time zone, and "
    "the tool returns an object with the event's identifier, its title, its start and end as ISO 8601 date-times "
    "and a link that opens it. The start must be an ISO 8601 date-time such as 2025-06-14T12:00; when the user gives "
    "only a day, choose nine in the morning, and when no length is given the event lasts one hour. Attendees are "
    "e-mail addresses; each receives an invitation right away, so only add the people the user named. If the new "
    "event overlaps another one the tool still creates it and lists the overlapping events in its answer, which "
    "should be mentioned to the user. Creating the same event twice makes two events.",
    ["title", "start"],
    title=("string", "a short title for the event"),
    start=("string", "the start, as an ISO 8601 date-time"),
    minutes=("integer", "the length of the event in minutes"),
    attendees=("array", "e-mail addresses of the people to invite"),
)
DOCS = function(
    "search_docs",
    "Search the company's internal documentation: engineering handbooks, how-to guides, API references, runbooks "
    "and the notes of past incidents. Use it when the user asks how something works in the company, where a "
    "procedure is written down, or what a service, setting or error message means; do not use it for the weather, "
    "for calendars or for questions about the outside world. The query is matched against titles, headings and text "
    "with a full-text index that ignores case and word endings, so a few precise keywords work better than a whole "
    "sentence. The tool returns up to ten hits, best first, each with the page title, its path, the date it was "
    "last edited and a short passage around the words that matched. Pages that were archived are left out unless "
    "the query says archived. Answer from the returned passages and name the pages they come from; if nothing "
    "relevant comes back, say so instead of inventing an answer.",
    ["query"],
    query=("string", "a few keywords to search for"),
    limit=("integer", "the largest number of hits to return, at most ten"),
)

# The tool list of each question: the agent's framework reorders and subsets it as the conversation moves on.
TOOL_LISTS = [[WEATHER, CALENDAR, DOCS], [DOCS, WEATHER, CALENDAR]]
SYSTEM = "You are a helpful assistant. Answer the user's question in one plain sentence, using the functions' results."
QUESTIONS = ["What is the weather like in Paris right now?",
             "Look up in our handbook which command rolls back a deploy."]


def run_tool(name: str, arguments: dict) -> dict:
    """Stand-ins for the real tools."""
    if name == "get_weather":
        return {"city": arguments.get("city"), "temp_c": 21, "sky": "sunny", "wind_kmh": 9, "rain_chance": 10}
    if name == "create_event":
        return {"id": "evt_0412", "title": arguments.get("title"), "start": arguments.get("start"),
                "link": "https://calendar.example.com/evt_0412"}
    return {"hits": [{"title": "Rolling back a deploy", "path": "/handbook/deploys/rollback",
                      "passage": "To roll back, run deployctl rollback with the number of the release to go back to."}]}


def ask(client: openai.OpenAI, messages: list[dict], tools: list[dict], tool_choice: str,
        max_tokens: int) -> ChatCompletionMessage:
    """One request, with a line on how much of its prompt the server found cached."""
    reply = client.chat.completions.create(model="default", messages=messages, tools=tools, tool_choice=tool_choice,
                                           temperature=0, max_tokens=max_tokens)
    shown = ", ".join(t["function"]["name"] for t in tools) if tool_choice != "none" else "no tools"
    print(f"  [{shown}] prompt {reply.usage.prompt_tokens} tokens, "
          f"{reply.usage.prompt_tokens_details.cached_tokens} cached")
    return reply.choices[0].message


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for question, tools in zip(QUESTIONS, TOOL_LISTS):
        print("question:", question)
        messages.append({"role": "user", "content": question})
        message = ask(client, messages, tools, "auto", max_tokens=64)
        if message.tool_calls:
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in message.tool_calls
            ]})
            for call in message.tool_calls:
                result = run_tool(call.function.name, json.loads(call.function.arguments))
                print(f"  {call.function.name}({call.function.arguments}) -> {json.dumps(result)}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
            # The results are in: ask for the reply with tool_choice "none", which leaves the tools out of the
            # prompt; offered them again, the 0.5B model repeats its call instead of answering.
            message = ask(client, messages, tools, "none", max_tokens=48)
        messages.append({"role": "assistant", "content": message.content})
        print("  answer:", message.content)


if __name__ == "__main__":
    main()
