"""factual_qa and multi_turn: questions about company profiles written from one template.

A question asks about one attribute of one company; the other profiles' values of that attribute are the rivals,
so mixing facts across documents answers with a rival. multi_turn gives the profiles in a first user turn with a
first question and the assistant's answer, then asks the judged question in a later user turn. The profiles are
needle's haystack too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sglang_pic.span_quality.items import CountTokens, Gold, Item, Turn, draw, question_block, spans
from sglang_pic.span_quality.judging import only_in, says
from sglang_pic.span_quality.pools import COLOURS, COMPANY_NAMES, FIRST_NAMES, LAST_NAMES, PRODUCTS, town
from sglang_pic.span_quality.sizes import TaskSizes


@dataclass(frozen=True)
class Company:
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


def _company(rng: random.Random, name: str) -> Company:
    v = {
        "year": str(rng.randint(1890, 2015)), "town": town(rng),
        "ceo": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}", "staff": str(rng.randint(12, 98) * 10),
        "product": rng.choice(PRODUCTS), "colour": rng.choice(COLOURS),
    }
    second = (rng.randint(int(v["year"]) + 1, 2024), town(rng))
    text = (
        f"{name}\n{name} is a maker of {v['product']}, founded in {v['year']} in the town of {v['town']}. Its chief "
        f"executive is {v['ceo']}. The company employs {v['staff']} people, and its logo is {v['colour']}. In "
        f"{second[0]} it opened a second plant in {second[1]}.\n"
    )
    return Company(name, v, text)


def companies(rng: random.Random, n: int) -> list[Company]:
    """`n` profiles of distinct companies."""
    return [_company(rng, name) for name in rng.sample(COMPANY_NAMES, n)]


QA_SYSTEM = "Answer the question using the documents. Reply with the answer only."


@dataclass(frozen=True)
class _Question:
    text: str
    gold: Gold


def _qa_question(rng: random.Random, docs: list[Company]) -> _Question | None:
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
    pool = companies(rng, sizes.qa_pool)

    def attempt() -> Item | None:
        docs = rng.sample(pool, sizes.qa_docs)
        question = _qa_question(rng, docs)
        if question is None:
            return None
        return Item(QA_SYSTEM, spans([d.text for d in docs]) + question_block(question.text), question.gold)

    return draw(samples, attempt)


def multi_turn(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    """The profiles arrive once, in the first user turn; the question that is judged comes two turns later."""
    rng = random.Random(seed)
    pool = companies(rng, sizes.qa_pool)

    def attempt() -> Item | None:
        docs = rng.sample(pool, sizes.qa_docs)
        first, second = _qa_question(rng, docs), _qa_question(rng, docs)
        if first is None or second is None or says(first.text + " " + first.gold.phrases[0], second.gold.phrases[0]):
            return None
        earlier = (Turn("user", spans([d.text for d in docs]) + question_block(first.text)),
                   Turn("assistant", first.gold.phrases[0]))
        return Item(QA_SYSTEM, question_block(second.text), second.gold, earlier=earlier)

    return draw(samples, attempt)
