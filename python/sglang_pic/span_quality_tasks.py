"""Span-quality tasks: prompts whose documents are spans, each with a gold answer, generated from a seed.

Each task writes `Item`s: a system prompt, a user turn whose documents are marked as spans (or earlier turns that
hold them), optional OpenAI tools (each becomes a span through the chat template, as `tool_spans: true` makes them
on the server) and the gold answer. Documents come from a pool shared by the samples, so they recur as in real
retrieval and agent traffic:
  factual_qa      company profiles written from one template, a question about one attribute of one company;
                  the other profiles' values of that attribute are the rivals, so mixing facts across documents
                  answers with a rival.
  tool_selection  several tool schemas and a request that one of them fits; right = that tool, called with JSON
                  arguments holding its required keys.
  needle          a unique fact in one span among company profiles; each item records the needle's depth bucket.
  late_records    employee or product records of 12 fields written from one template, a question about a field
                  that starts past the first 64 tokens of its record (past the default recomputed head); every
                  other record holds a rival value of that field.
  code_retrieval  real functions of Python's standard library (their source, by inspect.getsource, so the items
                  follow the installed Python) and a question quoting one function's docstring; right = its name.
  long_spans      a few company chronicles of 1-4K tokens each and a question about a fact somewhere inside one;
                  each item records the fact's depth bucket within its document.
  multi_turn      factual_qa's profiles as spans in a first user turn with a first question, the assistant's
                  answer, then a second question in a later user turn.
These need nothing but the package, so `check_span_quality` runs them on any model; the full benchmark
(benchmark/bench_span_quality.py) adds a RAG task of its own.

Every task draws from a generator seed of a split (`item_seed`): settings are chosen on `tuning` items and
reported on `heldout` ones, whose seeds lie in a disjoint range. The same seed always gives the same items.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from sglang_pic.entrypoints.tool_calls import ToolCall
from sglang_pic.frontend_lang.markers import span

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
class Turn:
    role: str  # "user" or "assistant", as in an OpenAI chat message
    content: str


@dataclass(frozen=True)
class Item:
    system: str
    user: str  # the last user turn: documents marked as spans, or a question about earlier turns' documents
    gold: Gold | ToolGold
    tools: tuple[dict, ...] = ()  # OpenAI tools, rendered by the chat template
    bucket: str | None = None  # the asked fact's depth bucket (needle, long_spans)
    earlier: tuple[Turn, ...] = ()  # turns between the system prompt and `user`, rendered by the chat template


@dataclass(frozen=True)
class TaskSizes:
    """How big each task's prompts are. With the defaults a CPU run of a 0.5B model takes minutes per task, except
    long_spans, whose prompts of several thousand tokens take that per request."""

    qa_docs: int = 5  # factual_qa's and multi_turn's
    qa_pool: int = 30
    num_tools: int = 5
    needle_spans: int = 8
    needle_pool: int = 40
    depth_buckets: int = 4  # needle's and long_spans'
    records_docs: int = 5
    records_pool: int = 30
    code_functions: int = 4
    long_docs: int = 3
    long_pool: int = 6
    long_tokens: tuple[int, int] = (1024, 4096)

    def __post_init__(self) -> None:
        for pool, drawn, what in ((self.qa_pool, self.qa_docs, "qa_pool < qa_docs"),
                                  (len(TOOL_SPECS), self.num_tools, f"num_tools > {len(TOOL_SPECS)} tools defined"),
                                  (self.needle_pool, self.needle_spans - 1, "needle_pool < needle_spans - 1"),
                                  (self.records_pool, self.records_docs, "records_pool < records_docs"),
                                  (len(STDLIB_FUNCTIONS), self.code_functions,
                                   f"code_functions > {len(STDLIB_FUNCTIONS)} functions listed"),
                                  (self.long_pool, self.long_docs, "long_pool < long_docs")):
            if drawn < 1 or pool < drawn:
                raise ValueError(f"task sizes: {what} (or a size below 1)")
        if not 1 <= self.depth_buckets <= self.needle_spans:
            raise ValueError(f"task sizes: depth_buckets must be in [1, needle_spans], got {self.depth_buckets}")
        low, high = self.long_tokens
        if low < 1 or high - low < 2 * LONG_ROOM:
            raise ValueError(f"task sizes: long_tokens must be MIN,MAX with MIN >= 1 and MAX - MIN >= {2 * LONG_ROOM}, "
                             f"got {low},{high}")


@dataclass(frozen=True)
class Task:
    name: str
    max_new_tokens: int
    make: Callable[[int, int, TaskSizes, CountTokens], list[Item]]  # (samples, seed, sizes, count) -> items


SPLITS = ("tuning", "heldout")  # choose settings on tuning items, report them on held-out ones


def item_seed(seed: int, task: str, split: str) -> int:
    """A task's generator seed in `split`: independent of which other tasks run, so a subset draws the same items;
    tuning seeds lie in [0, 2**32) and held-out ones in [2**32, 2**33), so the splits never share a seed."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    digest = hashlib.sha256(f"{seed}/{task}".encode()).digest()[:4]
    return SPLITS.index(split) << 32 | int.from_bytes(digest, "little")


def question_block(question: str) -> str:
    """How every task puts its question after the documents."""
    return f"Question: {question}"


def spans(docs: list[str]) -> str:
    """Documents as consecutive spans, as every task gives them."""
    return "".join(span(d) for d in docs)


MAX_ATTEMPTS_PER_ITEM = 100


def draw(samples: int, attempt: Callable[[], Item | None]) -> list[Item]:
    """`samples` items from attempts, each of which may find none (documents that allow no clean question); sizes
    that leave almost no clean question are refused rather than drawn from forever."""
    items: list[Item] = []
    for _ in range(samples * MAX_ATTEMPTS_PER_ITEM):
        if len(items) == samples:
            return items
        item = attempt()
        if item is not None:
            items.append(item)
    if len(items) < samples:
        raise ValueError(f"task sizes allow too few clean questions: {len(items)} of {samples} items drawn")
    return items


# ---- judging ---------------------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed: phrases then match as whole words."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _mention(phrase: str, padded_reply: str) -> int:
    at = padded_reply.find(f" {normalize(phrase)} ")
    return at if at >= 0 else len(padded_reply)


def says(text: str, phrase: str) -> bool:
    """Whether `text` holds `phrase` as whole words, as `judge` reads replies."""
    padded = f" {normalize(text)} "
    return _mention(phrase, padded) < len(padded)


def only_in(phrase: str, doc: str, docs: list[str]) -> bool:
    """Whether of `docs`, `doc` alone says `phrase`: a gold answer's document, with no rival saying it too."""
    return says(doc, phrase) and sum(says(d, phrase) for d in docs) == 1


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


@dataclass(frozen=True)
class _Question:
    text: str
    gold: Gold


def _qa_question(rng: random.Random, docs: list[_Company]) -> _Question | None:
    """A question about one attribute of one of `docs` whose value that profile alone says (None: no such one)."""
    target = rng.choice(docs)
    texts = [d.text for d in docs]
    attrs = [a for a in QA_QUESTIONS if only_in(target.values[a], target.text, texts)]
    if not attrs:
        return None
    attr = rng.choice(attrs)
    rivals = tuple(dict.fromkeys(d.values[attr] for d in docs if d is not target))
    return _Question(QA_QUESTIONS[attr].format(name=target.name), Gold((target.values[attr],), rivals))


def factual_qa(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    pool = _companies(rng, sizes.qa_pool)

    def attempt() -> Item | None:
        docs = rng.sample(pool, sizes.qa_docs)
        question = _qa_question(rng, docs)
        if question is None:
            return None
        return Item(QA_SYSTEM, spans([d.text for d in docs]) + question_block(question.text), question.gold)

    return draw(samples, attempt)


# ---- multi_turn --------------------------------------------------------------------------------------------------
def multi_turn(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    """The profiles arrive once, in the first user turn; the question that is judged comes two turns later."""
    rng = random.Random(seed)
    pool = _companies(rng, sizes.qa_pool)

    def attempt() -> Item | None:
        docs = rng.sample(pool, sizes.qa_docs)
        first, second = _qa_question(rng, docs), _qa_question(rng, docs)
        if first is None or second is None or says(first.text + " " + first.gold.phrases[0], second.gold.phrases[0]):
            return None
        earlier = (Turn("user", spans([d.text for d in docs]) + question_block(first.text)),
                   Turn("assistant", first.gold.phrases[0]))
        return Item(QA_SYSTEM, question_block(second.text), second.gold, earlier=earlier)

    return draw(samples, attempt)


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


def _unsaid_number(rng: random.Random, docs: list[str]) -> str:
    """A three-digit number none of `docs` says, so the document a fact puts it in is the only one with it."""
    while True:
        n = str(rng.randint(100, 999))
        if not any(says(d, n) for d in docs):
            return n


def depth_bucket(position: int, spans: int, buckets: int) -> str:
    b = position * buckets // spans
    return f"{100 * b // buckets}-{100 * (b + 1) // buckets}%"


def needle(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    hay = [c.text for c in _companies(rng, sizes.needle_pool)]
    span_count, items, order = sizes.needle_spans, [], []
    for _ in range(samples):
        order = order or rng.sample(range(span_count), span_count)  # every depth once per cycle
        position = order.pop()
        fact, question = rng.choice(NEEDLES)
        docs = rng.sample(hay, span_count - 1)
        slots = {"town": _town(rng), "colour": rng.choice(COLOURS), "n": _unsaid_number(rng, docs)}
        docs.insert(position, fact.format(**slots))
        user = spans(docs) + question_block(question.format(**slots))
        items.append(Item(NEEDLE_SYSTEM, user, Gold((slots["n"],)),
                          bucket=depth_bucket(position, span_count, sizes.depth_buckets)))
    return items


# ---- late_records ----------------------------------------------------------------------------------------------
RECORDS_SYSTEM = "Answer the question using the records. Reply with the answer only."
LATE_AFTER = 64  # a late field starts past this many tokens of its record: past the head the family was made for
DEPARTMENTS = ("Logistics", "Finance", "Research", "Legal", "Marketing", "Facilities", "Procurement", "Support")
JOB_TITLES = ("analyst", "engineer", "coordinator", "technician", "accountant", "designer", "planner", "auditor")
LAPTOPS = ("ThinkPad T14", "Latitude 5440", "EliteBook 840", "MacBook Air", "ZenBook 14", "Swift Go", "XPS 13")
CONTACT_NAMES = ("Alma", "Bruno", "Cora", "Dario", "Edith", "Filip", "Greta", "Hugo", "Ines", "Jonas", "Klara")
PRODUCT_NOUNS = ("kettle", "desk lamp", "office chair", "backpack", "water filter", "toaster", "bookshelf",
                 "umbrella", "thermos", "drill")
CATEGORIES = ("kitchen", "office", "outdoor", "lighting", "furniture", "tools", "travel")

Draw = Callable[[random.Random], str]


@dataclass(frozen=True)
class _Field:
    label: str
    question: str  # with a {name} slot: the record's name
    draw: Draw


@dataclass(frozen=True)
class _RecordKind:
    heading: str
    names: Callable[[random.Random, int], list[str]]  # (rng, n) -> n distinct record names
    fields: tuple[_Field, ...]


@dataclass(frozen=True)
class _Record:
    name: str
    values: dict[str, str]  # field label -> value
    text: str

    def field_start(self, label: str) -> int:
        """Where the field's line starts in the text."""
        return self.text.index(f"\n{label}: ") + 1


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1995, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _person(first_names: tuple[str, ...]) -> Draw:
    return lambda rng: f"{rng.choice(first_names)} {rng.choice(LAST_NAMES)}"


def _coded(prefix: str, low: int, high: int) -> Draw:
    return lambda rng: f"{prefix}{rng.randint(low, high)}"


def _choice(values: tuple[str, ...]) -> Draw:
    return lambda rng: rng.choice(values)


def _employee_names(rng: random.Random, n: int) -> list[str]:
    return rng.sample([f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES], n)


def _product_names(rng: random.Random, n: int) -> list[str]:
    return rng.sample([f"{r}{e} {noun}" for r in COMPANY_ROOTS for e in COMPANY_ENDS for noun in PRODUCT_NOUNS], n)


RECORD_KINDS = (
    _RecordKind("Employee record", _employee_names, (
        _Field("Employee number", "What is the employee number of {name}?", _coded("E-", 10000, 99999)),
        _Field("Department", "Which department does {name} work in?", _choice(DEPARTMENTS)),
        _Field("Job title", "What is the job title of {name}?", _choice(JOB_TITLES)),
        _Field("Office", "Which office is {name} in?", lambda rng: f"B{rng.randint(1, 9)}-{rng.randint(100, 499)}"),
        _Field("Start date", "On which date did {name} start?", _date),
        _Field("Manager", "Who is the manager of {name}?", _person(CONTACT_NAMES)),
        _Field("Home town", "What is the home town of {name}?", _town),
        _Field("Phone extension", "What is the phone extension of {name}?", _coded("", 2000, 8999)),
        _Field("Parking space", "Which parking space is assigned to {name}?", _coded("P-", 100, 999)),
        _Field("Laptop", "Which laptop does {name} use?", _choice(LAPTOPS)),
        _Field("Badge colour", "What colour is the badge of {name}?", _choice(COLOURS)),
        _Field("Emergency contact", "Who is the emergency contact of {name}?", _person(CONTACT_NAMES)),
    )),
    _RecordKind("Product record", _product_names, (
        _Field("Stock code", "What is the stock code of the {name}?", _coded("SKU-", 10000, 99999)),
        _Field("Category", "Which category is the {name} in?", _choice(CATEGORIES)),
        _Field("Supplier", "Who supplies the {name}?",
               lambda rng: f"{rng.choice(COMPANY_ROOTS)}{rng.choice(COMPANY_ENDS)} {rng.choice(COMPANY_KINDS)}"),
        _Field("Warehouse", "In which town is the warehouse of the {name}?", _town),
        _Field("Shelf", "On which shelf is the {name} stored?",
               lambda rng: f"{rng.choice('ABCDEFGH')}{rng.randint(1, 9)}"),
        _Field("Unit price in euros", "What is the unit price in euros of the {name}?",
               lambda rng: f"{rng.randint(5, 240)}.{rng.randint(0, 99):02d}"),
        _Field("Weight in grams", "How many grams does the {name} weigh?", _coded("", 150, 9000)),
        _Field("Colour", "What colour is the {name}?", _choice(COLOURS)),
        _Field("Units in stock", "How many units of the {name} are in stock?", _coded("", 20, 990)),
        _Field("Reorder level", "At how many units is the {name} reordered?", _coded("", 5, 95)),
        _Field("Last audit", "On which date was the {name} last audited?", _date),
        _Field("Returns desk", "Which returns desk handles the {name}?", _coded("desk ", 10, 99)),
    )),
)


def _record(rng: random.Random, kind: _RecordKind, name: str) -> _Record:
    values = {f.label: f.draw(rng) for f in kind.fields}
    text = f"{kind.heading}: {name}\n" + "".join(f"{label}: {value}\n" for label, value in values.items())
    return _Record(name, values, text)


def late_records(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    """Every record of an item shares one template, so the field asked about sits at nearly the same place in each
    and every other record holds a rival value for it; the head a request recomputes does not reach it."""
    rng = random.Random(seed)
    pools = [[_record(rng, kind, name) for name in kind.names(rng, sizes.records_pool)] for kind in RECORD_KINDS]

    def attempt() -> Item | None:
        kind_index = rng.randrange(len(RECORD_KINDS))
        docs = rng.sample(pools[kind_index], sizes.records_docs)
        target = rng.choice(docs)
        texts = [d.text for d in docs]
        late = [f for f in RECORD_KINDS[kind_index].fields
                if count(target.text[: target.field_start(f.label)]) >= LATE_AFTER
                and only_in(target.values[f.label], target.text, texts)]
        if not late:
            return None
        field = rng.choice(late)
        rivals = tuple(dict.fromkeys(d.values[field.label] for d in docs if d is not target))
        user = spans(texts) + question_block(field.question.format(name=target.name))
        return Item(RECORDS_SYSTEM, user, Gold((target.values[field.label],), rivals))

    return draw(samples, attempt)


# ---- code_retrieval --------------------------------------------------------------------------------------------
CODE_SYSTEM = "Answer the question using the code. Reply with the function's name only."
# Pure-Python functions of the standard library (inspect.getsource needs their source) whose docstrings open with a
# sentence that says what they do without naming them.
STDLIB_FUNCTIONS = (
    "textwrap.dedent", "textwrap.indent", "textwrap.shorten", "shlex.quote", "fnmatch.filter", "json.dumps",
    "base64.b64decode", "heapq.nsmallest", "statistics.stdev", "statistics.fmean", "statistics.multimode",
    "statistics.quantiles", "calendar.isleap", "calendar.monthrange", "difflib.get_close_matches", "difflib.ndiff",
    "ipaddress.collapse_addresses", "glob.glob", "shutil.copyfileobj", "shutil.copytree", "shutil.get_terminal_size",
    "urllib.parse.urljoin", "urllib.parse.parse_qs", "zipfile.is_zipfile", "uuid.uuid5",
    "email.utils.parseaddr", "mimetypes.guess_type", "copy.deepcopy", "dataclasses.asdict", "dataclasses.replace",
    "inspect.cleandoc", "types.new_class", "secrets.token_hex", "traceback.format_exception",
    "warnings.simplefilter", "subprocess.getoutput", "socket.create_connection", "getpass.getuser",
    "tempfile.mkdtemp",
)


@dataclass(frozen=True)
class _Function:
    name: str  # the bare name: the answer
    source: str
    quote: str  # its docstring's first sentence


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", paragraph)[0]


@functools.cache
def stdlib_functions() -> tuple[_Function, ...]:
    """STDLIB_FUNCTIONS as documents: read from the installed Python's library, which has no network to need."""
    out = []
    for qualified in STDLIB_FUNCTIONS:
        module, name = qualified.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), name)
        source = inspect.getsource(obj).rstrip("\n") + "\n"
        out.append(_Function(name, source, _first_sentence(inspect.getdoc(obj) or "")))
    return tuple(out)


def _code_question(rng: random.Random, docs: list[_Function]) -> tuple[_Function, str] | None:
    """A function of `docs` and its docstring quote such that only its source holds the quote and its name, and
    the quote names none of the functions (None: no such one)."""
    sources = [d.source for d in docs]
    fits = [d for d in docs if only_in(d.quote, d.source, sources) and only_in(d.name, d.source, sources)
            and not any(says(d.quote, other.name) for other in docs)]
    if not fits:
        return None
    target = rng.choice(fits)
    return target, f'Which function\'s docstring begins "{target.quote}"?'


def code_retrieval(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    functions = stdlib_functions()

    def attempt() -> Item | None:
        docs = rng.sample(functions, sizes.code_functions)
        picked = _code_question(rng, docs)
        if picked is None:
            return None
        target, question = picked
        rivals = tuple(d.name for d in docs if d is not target)
        user = spans([d.source for d in docs]) + question_block(question)
        return Item(CODE_SYSTEM, user, Gold((target.name,), rivals))

    return draw(samples, attempt)


# ---- long_spans ------------------------------------------------------------------------------------------------
LONG_SYSTEM = "Answer the question using the documents. Reply with the answer only."
LONG_ROOM = 64  # tokens a chronicle leaves below its length range and for the fact above it
FACILITIES = ("plant", "warehouse", "workshop", "depot", "laboratory", "showroom", "foundry", "mill")
CHRONICLE = (
    "In {year}, {company} opened a {facility} in {town}.",
    "In {year}, {person} took charge of the {facility} in {town}.",
    "By {year}, the {facility} in {town} had {staff} workers and made {product}.",
    "In {year}, a flood closed the {facility} in {town} for {weeks} weeks.",
    "In {year}, {company} bought a fleet of {colour} lorries for the {facility} in {town}.",
    "In {year}, {person} designed a new line of {product} at the {facility} in {town}.",
    "In {year}, the {facility} in {town} won a regional award for safety.",
    "In {year}, {company} signed a supply contract with a firm in {other_town}.",
)
LONG_FACT = "The {facility} of {company} in {town} keeps its spare keys in locker {n}."
LONG_QUESTION = "In which locker does the {facility} of {company} in {town} keep its spare keys?"


@dataclass(frozen=True)
class _Chronicle:
    company: str
    sites: tuple[tuple[str, str], ...]  # (facility, town)
    lines: tuple[str, ...]

    def text(self, fact: str | None = None, at: int = 0) -> str:
        """The chronicle, with `fact` (when given) as its line number `at`."""
        lines = list(self.lines)
        if fact is not None:
            lines.insert(at, fact)
        return f"The chronicle of {self.company}\n" + "".join(f"{line}\n" for line in lines)


def _chronicle(rng: random.Random, company: str, tokens: int, count: CountTokens) -> _Chronicle:
    """A chronicle of about `tokens` tokens (never more): events in year order at a few sites of the company."""
    sites = tuple(dict.fromkeys((rng.choice(FACILITIES), _town(rng)) for _ in range(6)))
    lines: list[str] = []
    year, total = rng.randint(1850, 1900), count(f"The chronicle of {company}\n")
    while True:
        facility, town = rng.choice(sites)
        year += rng.randint(0, 1)
        line = rng.choice(CHRONICLE).format(
            year=year, company=company, facility=facility, town=town, other_town=_town(rng),
            person=f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}", staff=rng.randint(12, 98) * 10,
            product=rng.choice(PRODUCTS), weeks=rng.randint(2, 9), colour=rng.choice(COLOURS))
        n = count(f"{line}\n")
        if total + n > tokens:
            return _Chronicle(company, sites, tuple(lines))
        lines.append(line)
        total += n


def long_spans(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    """Few documents of 1-4K tokens: most of each is shared span KV under any head or seams setting."""
    rng = random.Random(seed)
    low, high = sizes.long_tokens
    names = rng.sample([f"{r}{e} {k}" for r in COMPANY_ROOTS for e in COMPANY_ENDS for k in COMPANY_KINDS],
                       sizes.long_pool)
    pool = [_chronicle(rng, name, rng.randint(low + LONG_ROOM, high - LONG_ROOM), count) for name in names]
    items = []
    for _ in range(samples):
        docs = rng.sample(pool, sizes.long_docs)
        target = rng.choice(docs)
        facility, town = rng.choice(target.sites)
        n = _unsaid_number(rng, [d.text() for d in docs])
        at = rng.randint(0, len(target.lines))
        fact = LONG_FACT.format(facility=facility, company=target.company, town=town, n=n)
        texts = [d.text(fact, at) if d is target else d.text() for d in docs]
        question = LONG_QUESTION.format(facility=facility, company=target.company, town=town)
        items.append(Item(LONG_SYSTEM, spans(texts) + question_block(question), Gold((n,)),
                          bucket=depth_bucket(at, len(target.lines) + 1, sizes.depth_buckets)))
    return items


TASKS = {
    t.name: t
    for t in (
        Task("factual_qa", 16, factual_qa),
        Task("tool_selection", 56, tool_selection),
        Task("needle", 12, needle),
        Task("late_records", 16, late_records),
        Task("code_retrieval", 16, code_retrieval),
        Task("long_spans", 32, long_spans),
        Task("multi_turn", 16, multi_turn),
    )
}
