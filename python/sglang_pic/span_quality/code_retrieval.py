"""code_retrieval: real functions of Python's standard library (their source, by inspect.getsource, so the items
follow the installed Python) and a question quoting one function's docstring; right = its name."""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
from dataclasses import dataclass

from sglang_pic.span_quality.items import CountTokens, Gold, Item, draw, question_block, spans
from sglang_pic.span_quality.judging import only_in, says
from sglang_pic.span_quality.pools import STDLIB_FUNCTIONS
from sglang_pic.span_quality.sizes import TaskSizes

CODE_SYSTEM = "Answer the question using the code. Reply with the function's name only."


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
