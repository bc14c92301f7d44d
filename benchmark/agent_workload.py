"""An agent trace over a tool catalog, generated locally and deterministically from a seed.

Agent frameworks resend every tool's JSON schema and description on each turn, in registration order, and the set
drifts as tools are enabled or disabled: a prefix cache loses everything after the first change, while spans keep
each description. The catalog reads like real tool docs (sentence templates over a few vocabularies); each user
task names what exactly one of the session's current tools does, so the right call is known. Token counts are
estimated as words * 1.3 so the trace does not depend on a tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOKENS_PER_WORD = 1.3

VERBS = (
    ("search", "search for"), ("get", "look up"), ("create", "create"), ("update", "update"),
    ("delete", "delete"), ("list", "list"), ("export", "export"), ("summarize", "summarize"),
)
NOUNS = (
    ("invoices", "invoices"), ("calendar_events", "calendar events"), ("tickets", "support tickets"),
    ("forecasts", "weather forecasts"), ("flights", "flight bookings"), ("contacts", "contacts"),
    ("orders", "customer orders"), ("documents", "shared documents"), ("quotes", "stock quotes"),
    ("emails", "emails"), ("repositories", "code repositories"), ("meeting_notes", "meeting notes"),
    ("expenses", "expense reports"), ("shipments", "shipments"), ("playlists", "playlists"),
)
# (name, JSON type, what it means)
PROPERTIES = (
    ("query", "string", "free-text words that the records must match"),
    ("customer_id", "string", "the identifier of the customer account, such as C-1042"),
    ("limit", "integer", "the largest number of records to return"),
    ("start_date", "string", "the first day to include, as an ISO 8601 date"),
    ("include_archived", "boolean", "whether archived records count as matches"),
    ("amount", "number", "a money amount in the account's currency"),
    ("tags", "array", "labels that every returned record must carry"),
    ("city", "string", "the city the request is about"),
    ("priority", "integer", "an urgency level from 1 (low) to 5 (critical)"),
    ("filters", "object", "extra field-value pairs that narrow the search"),
)
SYSTEMS = ("billing", "calendar", "CRM", "inventory", "ticketing", "analytics", "messaging", "storage", "travel")
SCOPES = ("read", "write", "admin", "export", "audit")
SORT_KEYS = ("creation time", "last update", "relevance", "amount", "due date")
DESCRIPTION_SENTENCES = (
    "It calls the {system} service and returns the matching {noun} as a JSON object.",
    "Results are sorted by {sort_key}, newest first, and at most {n} items come back per call.",
    "The call is idempotent, so retrying it after a timeout is safe and never duplicates work.",
    ("Requests are rate limited to {n} per minute for each workspace; over the limit the tool returns an error "
     "with a hint saying when to retry."),
    "Dates are ISO 8601 strings in UTC unless the account has a different default time zone configured.",
    "Do not use this tool to {other}; a different tool in the catalog does that.",
    "If the request is ambiguous, ask the user a short clarifying question before calling the tool.",
    "Errors come back as an object with a numeric code and a human-readable message that can be shown as is.",
    "The response includes a cursor; pass it back unchanged to fetch the next page of {noun}.",
    "Access requires the {scope} permission on the {system} workspace, which most accounts have by default.",
    "Values are cached for {n} seconds, so repeated calls within that window return the same data.",
    "Fields the caller does not recognise should be ignored, since the {system} team adds new ones without notice.",
    "Large responses are truncated to the first {n} records, and a flag in the response says when that happened.",
    "Every call is written to the audit log of the {system} workspace together with the user who triggered it.",
)
RESULT_SENTENCES = (
    "Record {n}: {noun} entry {code} for {customer}, status {status}, updated on 2024-{month:02d}-{day:02d}.",
    "The {system} service matched {n} {noun} in {ms} ms and returned page {page} of the results.",
    "Entry {code} carries the tags {tag} and {tag2}, and its owner is {customer}.",
    "Note: {n} older {noun} were skipped because they are archived.",
    "Total amount across the returned {noun}: {amount} EUR, of which {amount2} EUR is still open.",
)
CUSTOMERS = ("Acme Corp", "Globex", "Initech", "Umbrella Ltd", "Stark Industries", "Wayne Foods", "Hooli")
STATUSES = ("open", "closed", "pending", "paid", "overdue", "in review")
TAGS = ("urgent", "finance", "q3", "europe", "internal", "vip", "follow-up")
CITIES = ("Paris", "Oslo", "Lisbon", "Nairobi", "Osaka", "Denver", "Krakow")
TASK_OPENERS = ("Please {action}.", "Could you {action} for me?", "I need you to {action}.", "Next, {action}.")


@dataclass(frozen=True)
class Tool:
    name: str
    action: str  # what it does, as a verb phrase ("look up invoices"): user tasks quote it
    noun: str  # what it acts on ("invoices"): its results talk about these
    description: str
    parameters: dict[str, Any]  # a JSON schema of an object

    def openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Turn:
    tools: tuple[int, ...]  # catalog indexes, in the order the request lists them
    target: int  # the one tool in `tools` that does the task
    task: str
    result: str  # the tool message answering the call


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class WorkloadConfig:
    num_tools: int = 40
    description_tokens: tuple[int, int] = (150, 600)
    sessions: int = 16
    turns: tuple[int, int] = (5, 15)
    session_tools: tuple[int, int] = (8, 20)
    result_tokens: tuple[int, int] = (100, 1000)
    change_prob: float = 0.3
    stable: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Workload:
    catalog: tuple[Tool, ...]
    sessions: tuple[Session, ...]

    def summary(self) -> dict[str, Any]:
        turns = [t for s in self.sessions for t in s.turns]
        changes = sum(a.tools != b.tools for s in self.sessions for a, b in zip(s.turns, s.turns[1:]))
        return {
            "tools": len(self.catalog),
            "sessions": len(self.sessions),
            "turns": len(turns),
            "tool_set_changes": changes,
            "mean_tools_per_turn": sum(len(t.tools) for t in turns) / len(turns),
            "mean_description_words": sum(len(t.description.split()) for t in self.catalog) / len(self.catalog),
            "mean_result_words": sum(len(t.result.split()) for t in turns) / len(turns),
        }


def words_for(tokens: tuple[int, int], rng: random.Random) -> int:
    return max(1, round(rng.randint(*tokens) / TOKENS_PER_WORD))


def fill(rng: random.Random, template: str, **known: str) -> str:
    """A template with its placeholders drawn from the vocabularies (`known` ones fixed)."""
    values = dict(
        system=rng.choice(SYSTEMS), scope=rng.choice(SCOPES), sort_key=rng.choice(SORT_KEYS), n=rng.randint(2, 500),
        customer=rng.choice(CUSTOMERS), status=rng.choice(STATUSES), tag=rng.choice(TAGS), tag2=rng.choice(TAGS),
        code=f"{rng.choice('ABCDEFGH')}-{rng.randint(1000, 9999)}", month=rng.randint(1, 12), day=rng.randint(1, 28),
        ms=rng.randint(3, 900), page=rng.randint(1, 9), amount=f"{rng.uniform(10, 9000):.2f}",
        amount2=f"{rng.uniform(0, 500):.2f}",
    )
    return template.format(**{**values, **known})


def make_tool(name: str, action: str, noun: str, other: str, rng: random.Random, words: int) -> Tool:
    props = rng.sample(PROPERTIES, rng.randint(1, 4))
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {p: {"type": kind, "description": doc} for p, kind, doc in props},
        "required": sorted(rng.sample([p for p, _, _ in props], rng.randint(1, len(props)))),
    }
    sentences = [f"Use this tool when the user wants to {action}."]
    sentences += [f"The {p} parameter is {doc}." for p, _, doc in props]
    while len(" ".join(sentences).split()) < words:
        sentences.append(fill(rng, rng.choice(DESCRIPTION_SENTENCES), noun=noun, other=other))
    return Tool(name, action, noun, " ".join(sentences), schema)


def build_catalog(cfg: WorkloadConfig, rng: random.Random) -> tuple[Tool, ...]:
    pairs = rng.sample([(v, n) for v in VERBS for n in NOUNS], cfg.num_tools)
    actions = [f"{v[1]} {n[1]}" for v, n in pairs]
    return tuple(
        make_tool(f"{v[0]}_{n[0]}", actions[i], n[1], actions[i - 1], rng, words_for(cfg.description_tokens, rng))
        for i, (v, n) in enumerate(pairs)
    )


def example_value(kind: str, rng: random.Random) -> str:
    """A value of a JSON type, written the way a user would say it in a task."""
    return {
        "string": lambda: repr(rng.choice(CITIES + CUSTOMERS)), "integer": lambda: str(rng.randint(1, 50)),
        "number": lambda: f"{rng.uniform(1, 900):.2f}", "boolean": lambda: rng.choice(("yes", "no")),
        "array": lambda: f"{rng.choice(TAGS)} and {rng.choice(TAGS)}",
        "object": lambda: f"status {rng.choice(STATUSES)}",
    }[kind]()


def make_task(tool: Tool, rng: random.Random) -> str:
    text = fill(rng, rng.choice(TASK_OPENERS), action=tool.action)
    props = tool.parameters["properties"]
    hints = [f"the {p} is {example_value(props[p]['type'], rng)}" for p in tool.parameters["required"]]
    return text + (f" Use these details: {', '.join(hints)}." if hints else "")


def make_result(tool: Tool, rng: random.Random, words: int) -> str:
    sentences = [f"{tool.name} returned:"]
    while len(" ".join(sentences).split()) < words:
        sentences.append(fill(rng, rng.choice(RESULT_SENTENCES), noun=tool.noun))
    return " ".join(sentences)


def next_tool_set(tools: list[int], num_tools: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """One drift of a session's tool list: a tool is enabled (appended), one disabled, or the list reordered."""
    choices = ["shuffle"] + ["add"] * (len(tools) < min(hi, num_tools)) + ["remove"] * (len(tools) > lo)
    change = rng.choice(choices)
    if change == "add":
        return tools + [rng.choice([i for i in range(num_tools) if i not in tools])]
    if change == "remove":
        gone = rng.choice(tools)
        return [i for i in tools if i != gone]
    return rng.sample(tools, len(tools))


def build_session(cfg: WorkloadConfig, catalog: tuple[Tool, ...], rng: random.Random) -> Session:
    lo, hi = (min(n, len(catalog)) for n in cfg.session_tools)
    tools = sorted(rng.sample(range(len(catalog)), rng.randint(lo, hi)))  # registration order of a subset
    turns = []
    for t in range(rng.randint(*cfg.turns)):
        if t and not cfg.stable and rng.random() < cfg.change_prob:
            tools = next_tool_set(tools, len(catalog), lo, hi, rng)
        target = rng.choice(tools)
        task = make_task(catalog[target], rng)
        result = make_result(catalog[target], rng, words_for(cfg.result_tokens, rng))
        turns.append(Turn(tuple(tools), target, task, result))
    return Session(tuple(turns))


def build_workload(cfg: WorkloadConfig) -> Workload:
    rng = random.Random(cfg.seed)
    catalog = build_catalog(cfg, rng)
    return Workload(catalog, tuple(build_session(cfg, catalog, rng) for _ in range(cfg.sessions)))


JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,),
}


def arguments_valid(schema: dict[str, Any], arguments: str) -> bool:
    """Whether a call's arguments parse as a JSON object with every required key and the schema's JSON types
    (the subset of JSON Schema the catalog uses; no dependency on a validator package)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or any(key not in value for key in schema.get("required", ())):
        return False
    for key, item in value.items():
        kind = schema["properties"].get(key, {}).get("type")
        if kind is None:
            continue
        if isinstance(item, bool) and kind != "boolean":  # bool is an int in Python, not in JSON
            return False
        if not isinstance(item, JSON_TYPES[kind]):
            return False
    return True
