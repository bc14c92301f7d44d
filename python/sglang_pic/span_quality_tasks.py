"""Span-quality tasks: prompts whose documents are spans, each with a gold answer, generated from a seed.

Each task writes `Item`s: a system prompt, a user turn whose documents are marked as spans, optional OpenAI tools
(each becomes a span through the chat template, as `tool_spans: true` makes them on the server) and the gold answer.
Documents come from a pool shared by the samples, so they recur as in real retrieval and agent traffic:
  factual_qa      company profiles written from one template, a question about one attribute of one company;
                  the other profiles' values of that attribute are the rivals, so mixing facts across documents
                  answers with a rival.
  tool_selection  several tool schemas and a request that one of them fits; right = that tool, called with JSON
                  arguments holding its required keys.
  needle          a unique fact in one span among company profiles; each item records the needle's depth bucket.
These need nothing but the package, so `check_span_quality` runs them on any model; the full benchmark
(benchmark/bench_span_quality.py) adds a RAG task of its own.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from sglang_pic.entrypoints.tool_calls import ToolCall
from sglang_pic.frontend_lang import span

CountTokens = Callable[[str], int]  # the model tokenizer's length of a text, without special tokens


@dataclass(frozen=True)
class Gold:
    """A right answer says every phrase of `phrases`; where the question has `rivals` (other documents' values,
    "no" against "yes") it says a gold phrase before any rival."""

    phrases: tuple[str, ...]
    rivals: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolGold:
    """A right reply calls `name` with JSON-object arguments that hold every key of `required`."""

    name: str
    required: tuple[str, ...]


@dataclass(frozen=True)
class Item:
    system: str
    user: str  # documents marked as spans
    gold: Gold | ToolGold
    tools: tuple[dict, ...] = ()  # OpenAI tools, rendered by the chat template
    bucket: str | None = None  # the needle's depth bucket


@dataclass(frozen=True)
class TaskSizes:
    """How big each task's prompts are; the defaults keep a CPU run of a 0.5B model to minutes."""

    qa_docs: int = 5
    qa_pool: int = 30
    num_tools: int = 5
    needle_spans: int = 8
    needle_pool: int = 40
    depth_buckets: int = 4

    def __post_init__(self) -> None:
        for pool, drawn, what in ((self.qa_pool, self.qa_docs, "qa_pool < qa_docs"),
                                  (len(TOOL_SPECS), self.num_tools, f"num_tools > {len(TOOL_SPECS)} tools defined"),
                                  (self.needle_pool, self.needle_spans - 1, "needle_pool < needle_spans - 1")):
            if drawn < 1 or pool < drawn:
                raise ValueError(f"task sizes: {what} (or a size below 1)")
        if not 1 <= self.depth_buckets <= self.needle_spans:
            raise ValueError(f"task sizes: depth_buckets must be in [1, needle_spans], got {self.depth_buckets}")


@dataclass(frozen=True)
class Task:
    name: str
    max_new_tokens: int
    make: Callable[[int, int, TaskSizes, CountTokens], list[Item]]  # (samples, seed, sizes, count) -> items


def question_block(question: str) -> str:
    """How every task puts its question after the documents."""
    return f"Question: {question}"


# ---- judging ---------------------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed: phrases then match as whole words."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _mention(phrase: str, padded_reply: str) -> int:
    at = padded_reply.find(f" {normalize(phrase)} ")
    return at if at >= 0 else len(padded_reply)


def judge(gold: Gold | ToolGold, reply: str, calls: list[ToolCall]) -> tuple[bool, str]:
    """(whether `reply` is right, its key): replies with the same key give the same answer. A phrase answer's key
    is the gold and rival phrases it says, in order (its normalized text if it says none); a tool answer's key is
    its first call, arguments canonicalized."""
    if isinstance(gold, ToolGold):
        if not calls:
            return False, "text: " + normalize(reply)
        call = calls[0]
        args = json.loads(call.arguments)
        right = call.name == gold.name and all(k in args for k in gold.required)
        return right, f"{call.name}({json.dumps(args, sort_keys=True)})"
    padded = f" {normalize(reply)} "
    where = {p: _mention(p, padded) for p in (*gold.phrases, *gold.rivals)}
    said = sorted((at, p) for p, at in where.items() if at < len(padded))
    right = all(where[p] < len(padded) for p in gold.phrases) and said[0][1] in gold.phrases
    return right, " | ".join(normalize(p) for _, p in said) if said else normalize(reply)


# ---- company profiles (factual_qa's documents, needle's haystack) ---------------------------------------------
COMPANY_ROOTS = ("Vel", "Tor", "Zan", "Quor", "Mir", "Kest", "Lum", "Brix", "Orv", "Pell", "Dax", "Sol", "Nym", "Fen")
COMPANY_ENDS = ("ora", "ex", "ion", "ara", "ix", "ent", "ano", "eth")
COMPANY_KINDS = ("Systems", "Industries", "Labs", "Works", "Foods", "Motors", "Instruments", "Textiles")
PRODUCTS = (
    "bicycle frames", "water pumps", "solar panels", "ceramic tiles", "wool blankets", "microscopes", "canned soup",
    "garden tools", "radio receivers", "paper lanterns", "leather boots", "glass bottles",
)
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown")
FIRST_NAMES = ("Anna", "Boris", "Chiara", "David", "Emil", "Fiona", "Goran", "Hanna", "Igor", "Jana", "Kofi", "Lena")
LAST_NAMES = (
    "Albrecht", "Barros", "Conti", "Duval", "Eriksen", "Fischer", "Greco", "Horvath", "Ibsen", "Janssen", "Kovacs",
    "Laurent", "Mendes", "Nilsson", "Oyelaran", "Pavlov", "Reyes", "Sato", "Tamm", "Varga", "Weber", "Zielinski",
)
TOWN_HEADS = ("Ash", "Bel", "Cran", "Dun", "Elm", "Fair", "Glen", "Hollow", "Iver", "Kirk", "Lang", "Marsh", "Nor",
              "Pine", "Raven", "Stone", "Thorn", "Wil")
TOWN_TAILS = ("ford", "moor", "wick", "bury", "field", "haven", "stead", "ton", "mouth", "dale", "holm", "brook")


@dataclass(frozen=True)
class _Company:
    name: str
    values: dict[str, str]  # attribute -> value
    text: str


QA_QUESTIONS = {
    "year": "In which year was {name} founded?",
    "town": "In which town was {name} founded?",
    "ceo": "Who is the chief executive of {name}?",
    "staff": "How many people does {name} employ?",
    "product": "What does {name} make?",
    "colour": "What colour is the logo of {name}?",
}


def _town(rng: random.Random) -> str:
    return rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)


def _company(rng: random.Random, name: str) -> _Company:
    v = {
        "year": str(rng.randint(1890, 2015)), "town": _town(rng),
        "ceo": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}", "staff": str(rng.randint(12, 98) * 10),
        "product": rng.choice(PRODUCTS), "colour": rng.choice(COLOURS),
    }
    second = (rng.randint(int(v["year"]) + 1, 2024), _town(rng))
    text = (
        f"{name}\n{name} is a maker of {v['product']}, founded in {v['year']} in the town of {v['town']}. Its chief "
        f"executive is {v['ceo']}. The company employs {v['staff']} people, and its logo is {v['colour']}. In "
        f"{second[0]} it opened a second plant in {second[1]}.\n"
    )
    return _Company(name, v, text)


def _companies(rng: random.Random, n: int) -> list[_Company]:
    names = rng.sample([f"{r}{e} {k}" for r in COMPANY_ROOTS for e in COMPANY_ENDS for k in COMPANY_KINDS], n)
    return [_company(rng, name) for name in names]


# ---- factual_qa ------------------------------------------------------------------------------------------------
QA_SYSTEM = "Answer the question using the documents. Reply with the answer only."


def factual_qa(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    pool = _companies(rng, sizes.qa_pool)
    items = []
    while len(items) < samples:
        docs = rng.sample(pool, sizes.qa_docs)
        target = rng.choice(docs)
        attrs = [a for a in QA_QUESTIONS if [d.values[a] for d in docs].count(target.values[a]) == 1]
        attr = rng.choice(attrs)
        rivals = tuple(dict.fromkeys(d.values[attr] for d in docs if d is not target))
        question = QA_QUESTIONS[attr].format(name=target.name)
        user = "".join(span(d.text) for d in docs) + question_block(question)
        items.append(Item(QA_SYSTEM, user, Gold((target.values[attr],), rivals)))
    return items


# ---- tool_selection --------------------------------------------------------------------------------------------
TOOL_SYSTEM = "You are a helpful assistant. When one of the tools fits the request, call it."
CITIES = ("Paris", "Oslo", "Lisbon", "Nairobi", "Osaka", "Denver", "Prague", "Lima", "Hanoi", "Dublin")
VALUES: dict[str, tuple[str, ...]] = {
    "city": CITIES, "origin": CITIES, "destination": CITIES, "pickup": ("the airport", "the station", "my hotel"),
    "currency": ("EUR", "USD", "JPY", "GBP", "CHF"), "amount": ("25", "120", "300", "1500"),
    "person": ("anna@example.com", "kofi@example.com", "lena@example.com"),
    "subject": ("Quarterly report", "Dinner on Friday", "Project kickoff"),
    "cuisine": ("Thai", "Italian", "Mexican", "Ethiopian"), "symbol": ("AAPL", "NVDA", "TSLA", "SAP"),
    "phrase": ("good morning", "where is the station", "thank you very much"),
    "language": ("French", "Japanese", "German", "Swahili"), "minutes": ("5", "10", "25", "45"),
    "title": ("Dentist appointment", "Team lunch", "Piano lesson"),
    "date": ("2025-03-14", "2025-06-02", "2025-11-20"), "time": ("09:30", "14:00", "18:15"),
    "music": ("jazz", "Beethoven", "Nina Simone"), "topic": ("electric cars", "the Olympics", "climate policy"),
    "percent": ("15", "18", "20"),
}


@dataclass(frozen=True)
class _ToolSpec:
    name: str
    description: str
    params: dict[str, tuple[str, str, str]]  # argument -> (JSON type, description, VALUES key)
    required: tuple[str, ...]
    request: str  # the user's request, with {argument} slots


TOOL_SPECS = (
    _ToolSpec("get_weather", "Get the current weather in a city.",
              {"city": ("string", "The city name.", "city")}, ("city",),
              "What's the weather like in {city} right now?"),
    _ToolSpec("convert_currency", "Convert an amount of money from one currency to another.",
              {"amount": ("number", "The amount to convert.", "amount"),
               "from_currency": ("string", "ISO code of the source currency.", "currency"),
               "to_currency": ("string", "ISO code of the target currency.", "currency")},
              ("amount", "from_currency", "to_currency"), "How much is {amount} {from_currency} in {to_currency}?"),
    _ToolSpec("send_email", "Send an email to a recipient.",
              {"to": ("string", "The recipient's address.", "person"),
               "subject": ("string", "The subject line.", "subject")},
              ("to", "subject"), "Email {to} with the subject '{subject}'."),
    _ToolSpec("book_flight", "Book a flight between two cities on a given date.",
              {"origin": ("string", "Departure city.", "origin"),
               "destination": ("string", "Arrival city.", "destination"),
               "date": ("string", "Departure date, YYYY-MM-DD.", "date")},
              ("origin", "destination", "date"), "Book me a flight from {origin} to {destination} on {date}."),
    _ToolSpec("find_restaurants", "Find restaurants in a city that serve a cuisine.",
              {"city": ("string", "The city to search.", "city"), "cuisine": ("string", "Kind of food.", "cuisine")},
              ("city", "cuisine"), "Find me a {cuisine} restaurant in {city}."),
    _ToolSpec("get_stock_price", "Get the latest trading price of a stock.",
              {"symbol": ("string", "The ticker symbol.", "symbol")}, ("symbol",),
              "What is {symbol} trading at today?"),
    _ToolSpec("translate_text", "Translate a text into another language.",
              {"text": ("string", "The text to translate.", "phrase"),
               "target_language": ("string", "The language to translate into.", "language")},
              ("text", "target_language"), "How do you say '{text}' in {target_language}?"),
    _ToolSpec("set_timer", "Start a countdown timer.",
              {"minutes": ("integer", "Length of the timer in minutes.", "minutes")}, ("minutes",),
              "Set a timer for {minutes} minutes."),
    _ToolSpec("create_event", "Add an event to the user's calendar.",
              {"title": ("string", "What the event is.", "title"), "date": ("string", "YYYY-MM-DD.", "date"),
               "time": ("string", "HH:MM, 24-hour clock.", "time")},
              ("title", "date"), "Put '{title}' in my calendar on {date} at {time}."),
    _ToolSpec("play_music", "Play a song, artist or genre on the living-room speaker.",
              {"query": ("string", "What to play.", "music")}, ("query",), "Play some {query} on the speaker."),
    _ToolSpec("search_news", "Search recent news articles about a topic.",
              {"topic": ("string", "The subject of the articles.", "topic")}, ("topic",),
              "Show me the latest news about {topic}."),
    _ToolSpec("calculate_tip", "Compute the tip on a restaurant bill.",
              {"bill_amount": ("number", "The bill in dollars.", "amount"),
               "tip_percent": ("number", "The tip as a percentage.", "percent")},
              ("bill_amount", "tip_percent"), "What is a {tip_percent} percent tip on a {bill_amount} dollar bill?"),
)


def tool_schema(spec: _ToolSpec) -> dict:
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


# ---- needle ----------------------------------------------------------------------------------------------------
NEEDLE_SYSTEM = "Answer the question using the passages. Reply with the answer only."
NEEDLES = (
    ("Archive note\nThe key to the archive room of {town} station is kept in locker {n}.\n",
     "In which locker is the key to the archive room of {town} station kept?"),
    ("Library note\nThe {colour} notebook was left in room {n} of the {town} library.\n",
     "In which room of the {town} library was the {colour} notebook left?"),
)


def depth_bucket(position: int, spans: int, buckets: int) -> str:
    b = position * buckets // spans
    return f"{100 * b // buckets}-{100 * (b + 1) // buckets}%"


def needle(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    hay = [c.text for c in _companies(rng, sizes.needle_pool)]
    spans, items, order = sizes.needle_spans, [], []
    for _ in range(samples):
        order = order or rng.sample(range(spans), spans)  # every depth once per cycle
        position = order.pop()
        fact, question = rng.choice(NEEDLES)
        slots = {"town": _town(rng), "colour": rng.choice(COLOURS), "n": str(rng.randint(100, 999))}
        docs = rng.sample(hay, spans - 1)
        docs.insert(position, fact.format(**slots))
        user = "".join(span(d) for d in docs) + question_block(question.format(**slots))
        items.append(Item(NEEDLE_SYSTEM, user, Gold((slots["n"],)),
                          bucket=depth_bucket(position, spans, sizes.depth_buckets)))
    return items


TASKS = {
    t.name: t
    for t in (
        Task("factual_qa", 16, factual_qa),
        Task("tool_selection", 56, tool_selection),
        Task("needle", 12, needle),
    )
}
