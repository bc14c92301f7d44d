"""late_records: employee or product records of 12 fields written from one template, and a question about a field
that starts past the first 64 tokens of its record (past the default recomputed head); every other record holds a
rival value of that field."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from sglang_pic.span_quality.items import CountTokens, Gold, Item, draw, question_block, spans
from sglang_pic.span_quality.judging import only_in
from sglang_pic.span_quality.pools import (
    COLOURS,
    COMPANY_ENDS,
    COMPANY_KINDS,
    COMPANY_ROOTS,
    FIRST_NAMES,
    LAST_NAMES,
    town,
)
from sglang_pic.span_quality.sizes import TaskSizes

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
        _Field("Home town", "What is the home town of {name}?", town),
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
        _Field("Warehouse", "In which town is the warehouse of the {name}?", town),
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
