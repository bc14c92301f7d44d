"""long_spans: a few company chronicles of 1-4K tokens each and a question about a fact somewhere inside one; each
item records the fact's depth bucket within its document."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sglang_pic.span_quality.items import CountTokens, Gold, Item, depth_bucket, question_block, spans
from sglang_pic.span_quality.judging import unsaid_number
from sglang_pic.span_quality.pools import COLOURS, COMPANY_NAMES, FIRST_NAMES, LAST_NAMES, PRODUCTS, town
from sglang_pic.span_quality.sizes import LONG_ROOM, TaskSizes

LONG_SYSTEM = "Answer the question using the documents. Reply with the answer only."
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
    sites = tuple(dict.fromkeys((rng.choice(FACILITIES), town(rng)) for _ in range(6)))
    lines: list[str] = []
    year, total = rng.randint(1850, 1900), count(f"The chronicle of {company}\n")
    while True:
        facility, place = rng.choice(sites)
        year += rng.randint(0, 1)
        line = rng.choice(CHRONICLE).format(
            year=year, company=company, facility=facility, town=place, other_town=town(rng),
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
    names = rng.sample(COMPANY_NAMES, sizes.long_pool)
    pool = [_chronicle(rng, name, rng.randint(low + LONG_ROOM, high - LONG_ROOM), count) for name in names]
    items = []
    for _ in range(samples):
        docs = rng.sample(pool, sizes.long_docs)
        target = rng.choice(docs)
        facility, place = rng.choice(target.sites)
        n = unsaid_number(rng, [d.text() for d in docs])
        at = rng.randint(0, len(target.lines))
        fact = LONG_FACT.format(facility=facility, company=target.company, town=place, n=n)
        texts = [d.text(fact, at) if d is target else d.text() for d in docs]
        question = LONG_QUESTION.format(facility=facility, company=target.company, town=place)
        items.append(Item(LONG_SYSTEM, spans(texts) + question_block(question), Gold((n,)),
                          bucket=depth_bucket(at, len(target.lines) + 1, sizes.depth_buckets)))
    return items
