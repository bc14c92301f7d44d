"""needle: a unique fact in one span among company profiles; each item records the needle's depth bucket."""

from __future__ import annotations

import random

from sglang_pic.span_quality.company_qa import companies
from sglang_pic.span_quality.items import CountTokens, Gold, Item, depth_bucket, question_block, spans
from sglang_pic.span_quality.judging import unsaid_number
from sglang_pic.span_quality.pools import COLOURS, town
from sglang_pic.span_quality.sizes import TaskSizes

NEEDLE_SYSTEM = "Answer the question using the passages. Reply with the answer only."
NEEDLES = (
    ("Archive note\nThe key to the archive room of {town} station is kept in locker {n}.\n",
     "In which locker is the key to the archive room of {town} station kept?"),
    ("Library note\nThe {colour} notebook was left in room {n} of the {town} library.\n",
     "In which room of the {town} library was the {colour} notebook left?"),
)


def needle(samples: int, seed: int, sizes: TaskSizes, count: CountTokens) -> list[Item]:
    rng = random.Random(seed)
    hay = [c.text for c in companies(rng, sizes.needle_pool)]
    span_count, items, order = sizes.needle_spans, [], []
    for _ in range(samples):
        order = order or rng.sample(range(span_count), span_count)  # every depth once per cycle
        position = order.pop()
        fact, question = rng.choice(NEEDLES)
        docs = rng.sample(hay, span_count - 1)
        slots = {"town": town(rng), "colour": rng.choice(COLOURS), "n": unsaid_number(rng, docs)}
        docs.insert(position, fact.format(**slots))
        user = spans(docs) + question_block(question.format(**slots))
        items.append(Item(NEEDLE_SYSTEM, user, Gold((slots["n"],)),
                          bucket=depth_bucket(position, span_count, sizes.depth_buckets)))
    return items
