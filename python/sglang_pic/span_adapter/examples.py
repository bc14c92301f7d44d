"""Training prompts, rendered and tokenized exactly as the server does (chat template, markers, span settings), then
laid out as the engine attends to it (layout.py). Four kinds of turn: a user message holding passages of the corpus
as spans and a question about them; the same with standard-library functions as code passages; a request for one
of several tools whose descriptions are spans (`tool_spans`, as agents send them); and package records (metadata
fields of installed distributions, one shape, rival values; in half the turns one template for all) as spans with a
question about one field of one record, sometimes as the second question of a conversation whose first one the
assistant answered. The questions are generic (summarize, locate, quote, continue a sentence, explain): the
teacher's own answer is the target, so no question needs a gold answer. Quoting and continuing make the answer copy
a span's exact words, which span attention loses first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sglang_pic.entrypoints.chat_template import load_chat_template, render_chat
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput, TokenizedGenerateReq
from sglang_pic.managers.req import Req
from sglang_pic.managers.request_builder import ContextOverflow, RequestBuilder
from sglang_pic.model_config import ModelConfig
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_adapter.corpus import Corpus, Function, Package
from sglang_pic.span_adapter.layout import SpanLayout, segments_layout
from sglang_pic.tokenizer import load_tokenizer

SYSTEMS = (
    "You are a helpful assistant.",
    "Answer from the documents. Be brief.",
    "You answer questions about the provided texts in one or two sentences.",
    "Use only the information in the documents below.",
)
QUESTIONS = (
    "What does the text say about {word}?",
    "Which of the texts mentions {word}? Say what it says about it.",
    "Summarize the text that mentions {word} in one sentence.",
    "Quote the sentence that contains \"{word}\".",
    "Is \"{word}\" mentioned above? Answer yes or no, then explain in one sentence.",
    "What is the main topic of each text? One line per text.",
    "Explain {word} as the texts describe it.",
    "List three terms that appear in the text about {word}.",
    "Continue this sentence from the texts with its next words: \"{opening}\"",
    "Which text, counting from the first, mentions {word}? Answer with its number.",
    "Copy the first sentence of the text that mentions {word}.",
)
CODE_QUESTIONS = (
    "What does the function {name} return?",
    "Which of these functions would you call to {summary}?",
    "Explain what {name} does, step by step.",
    "What arguments does {name} take, and what are they for?",
    "Write a one-line example that calls {name}.",
)
RECORD_QUESTIONS = {
    "version": "Which version of {name} do the records give?",
    "summary": "What is {name} for, according to its record?",
    "license": "Under which licence is {name} released?",
    "author": "Who is the author of {name}?",
    "python": "Which Python versions does {name} require?",
    "dependencies": "How many dependencies does {name} list?",
    "home page": "What is the home page of {name}?",
}
RECORD_SENTENCES = {
    "version": "The version described is {value}.",
    "summary": "It is described as: {value}",
    "license": "It is released under the {value} licence.",
    "author": "It was written by {value}.",
    "python": "It needs Python {value}.",
    "dependencies": "It lists {value} dependencies.",
    "home page": "Its home page is {value}.",
}
PREFACES = ("", "", "Here are some documents.\n", "Read the following texts.\n")
KINDS = {"docs": 0.45, "code": 0.15, "tools": 0.2, "records": 0.2}  # turn kinds and their default weights
SECOND_QUESTION_SHARE = 0.35  # records turns asked as a conversation's second question
# Records turns whose records share one template (one format, one field order), as a catalogue or a table rendered
# to text writes them: a field sits at the same offset of every span, so only the record's name tells it apart from
# its rivals, which span attention loses most (wrong answers under it mostly name another document's value).
UNIFORM_RECORDS_SHARE = 0.5
DRAWS = 50  # prompts drawn for one example before giving up on ever fitting the model's context


@dataclass(frozen=True)
class ExampleSizes:
    min_docs: int = 2
    max_docs: int = 6
    min_passage_tokens: int = 48
    max_passage_tokens: int = 400


@dataclass
class Example:
    layout: SpanLayout  # the prompt as the engine attends to it under the example's span setting
    loss_rows: list[int]  # layout rows whose next-token distribution is trained: the text after the first span
    span_rows: list[int]  # layout rows of span tokens


class ExampleMaker:
    """Builds examples without a model: the server's chat rendering, segmenter and span settings."""

    def __init__(self, model_dir: str, corpus: Corpus, sizes: ExampleSizes, kinds: dict[str, float] | None = None,
                 answer_tokens: int = 1) -> None:
        """`kinds`: the turn kinds' weights (default KINDS); a kind the model or corpus cannot make is left out.
        `answer_tokens`: the room a prompt leaves in the model's context for the teacher's answer."""
        self.args = ServerArgs.from_kwargs(model_path=model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        config = ModelConfig.from_server_args(model_dir, self.args, device="cpu")
        self.builder = RequestBuilder(self.args, self.tokenizer, config)
        self.chat_template = load_chat_template(None, self.tokenizer)
        self.corpus = corpus
        self.sizes = sizes
        self.answer_tokens = answer_tokens
        self.eos_token_ids = sorted(config.eos_token_ids)
        left_out = {"tools"} if not self._renders_tools() else set()
        if sizes.max_docs < 2 or len(corpus.packages) < sizes.max_docs:  # rival values need two records
            left_out.add("records")
        self.kinds = {k: w for k, w in (kinds or KINDS).items() if k not in left_out and w > 0}
        if not self.kinds:
            raise ValueError(f"no turn kind left to draw from (weights {kinds or KINDS}, {sorted(left_out)} left out)")
        self.turns = {"docs": self._docs, "code": self._code, "tools": self._tools, "records": self._records}

    def _renders_tools(self) -> bool:
        """Whether the chat template shows tools (tool turns need it to mark their descriptions as spans)."""
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                     tools=[_tool(self.corpus.functions[0])], tool_spans=True)
        try:
            render_chat(body, self.tokenizer, self.chat_template, self.args)
        except ValueError:
            return False
        return True

    def _passage(self, rng: random.Random) -> str:
        target = rng.randint(self.sizes.min_passage_tokens, self.sizes.max_passage_tokens)
        i = rng.randrange(len(self.corpus.paragraphs))
        parts, tokens = [], 0
        while tokens < target and i < len(self.corpus.paragraphs):
            para = self.corpus.paragraphs[i]
            parts.append(para)
            tokens += len(self.tokenizer.encode(para, add_special_tokens=False))
            i += 1
        return self._cut("\n".join(parts), target)

    def _cut(self, text: str, tokens: int) -> str:
        return self.tokenizer.decode(self.tokenizer.encode(text, add_special_tokens=False)[:tokens]).strip()

    def prompt(self, rng: random.Random) -> str:
        kind = rng.choices(list(self.kinds), list(self.kinds.values()))[0]
        system = {"role": "system", "content": rng.choice(SYSTEMS)}
        return render_chat(self.turns[kind](rng, system), self.tokenizer, self.chat_template, self.args)

    def _tools(self, rng: random.Random, system: dict) -> ChatCompletionRequest:
        funcs = rng.sample(self.corpus.functions, rng.randint(self.sizes.min_docs + 1, self.sizes.max_docs + 2))
        funcs = list({f.name: f for f in funcs}.values())  # tool names must be distinct
        target = rng.choice(funcs)
        return ChatCompletionRequest(messages=[system, {"role": "user", "content": f"Please {target.summary}"}],
                                     tools=[_tool(f) for f in funcs], tool_spans=True)

    def _code(self, rng: random.Random, system: dict) -> ChatCompletionRequest:
        funcs = rng.sample(self.corpus.functions, rng.randint(self.sizes.min_docs, self.sizes.max_docs))
        docs = [self._cut(f.source, self.sizes.max_passage_tokens) for f in funcs]
        target = rng.choice(funcs)
        question = rng.choice(CODE_QUESTIONS).format(name=target.name, summary=target.summary)
        return _ask(rng, system, docs, question)

    def _docs(self, rng: random.Random, system: dict) -> ChatCompletionRequest:
        docs = [self._passage(rng) for _ in range(rng.randint(self.sizes.min_docs, self.sizes.max_docs))]
        chosen = rng.choice(docs).split()
        words = [w.strip(".,;:()\"'`") for w in chosen]
        words = [w for w in words if len(w) >= 5 and w.isalpha()] or ["the first text"]
        start = rng.randrange(max(1, len(chosen) - 12))
        opening = " ".join(chosen[start: start + rng.randint(5, 9)])
        return _ask(rng, system, docs, rng.choice(QUESTIONS).format(word=rng.choice(words), opening=opening))

    def _records(self, rng: random.Random, system: dict) -> ChatCompletionRequest:
        packages = rng.sample(self.corpus.packages, rng.randint(max(2, self.sizes.min_docs), self.sizes.max_docs))
        template = _record_template(rng) if rng.random() < UNIFORM_RECORDS_SHARE else None
        docs = [self._cut(_record_text(p, rng, template), self.sizes.max_passage_tokens) for p in packages]
        (first, answer), (second, _) = (_record_question(rng.choice(packages), rng) for _ in range(2))
        later = None
        if rng.random() < SECOND_QUESTION_SHARE:
            later = [{"role": "assistant", "content": answer}, {"role": "user", "content": second}]
        return _ask(rng, system, docs, first, later)

    def _build(self, rng: random.Random, given: dict) -> TokenizedGenerateReq:
        """A prompt drawn until one leaves room for the answer in the model's context (a long record or tool list
        can overflow a small model's), as the engine's request for it."""
        params = {"max_new_tokens": self.answer_tokens}
        for _ in range(DRAWS):
            try:
                return self.builder.build(GenerateReqInput(text=self.prompt(rng), sampling_params=params, **given))[0]
            except ContextOverflow:
                continue
        raise ValueError(f"{DRAWS} prompts in a row overflow the model's context of {self.builder.context_len} tokens "
                         f"with {self.answer_tokens} answer tokens; lower --docs, --passage-tokens or --answer-tokens")

    def example(self, rng: random.Random, setting: dict) -> Example:
        """An example under `setting` (span fields such as span_anchor, span_head_tokens); an empty setting is a
        dense turn: the same prompt with full attention, trained on the same rows."""
        given = setting or {"span_anchor": "none", "span_head_tokens": 0}
        msg = self._build(rng, given)
        layout = segments_layout(Req.from_wire(msg).segments)
        first_span = next(i for i, s in enumerate(layout.scope) if s is not None)
        loss_rows = [i for i in range(first_span, len(layout.ids)) if layout.scope[i] is None]
        span_rows = [i for i, s in enumerate(layout.scope) if s is not None and layout.visible[i]]
        if not setting:
            index = layout.dense_index()
            loss_rows, span_rows = [index[i] for i in loss_rows], [index[i] for i in span_rows]
            ids = layout.dense_ids()
            layout = SpanLayout()
            layout.add(ids, 0, None, True)
        return Example(layout, loss_rows, span_rows)


def _ask(rng: random.Random, system: dict, docs: list[str], question: str, later: list[dict] | None = None
         ) -> ChatCompletionRequest:
    """A user turn holding the documents as spans, then the question (and the `later` turns of the conversation)."""
    user = rng.choice(PREFACES) + "".join(span(d + "\n") for d in docs) + question
    return ChatCompletionRequest(messages=[system, {"role": "user", "content": user}, *(later or [])])


def _record_template(rng: random.Random) -> tuple[bool, list[str]]:
    """A records turn's shared template: labelled lines (True) or sentences, and the order of the fields."""
    return rng.random() < 0.5, rng.sample(list(RECORD_SENTENCES), len(RECORD_SENTENCES))


def _record_text(package: Package, rng: random.Random, template: tuple[bool, list[str]] | None = None) -> str:
    """The package's facts as labelled lines or as sentences, in the template's order, or without one in a
    shuffled order of their own (a fact sits at a different offset in each record)."""
    if template is None:
        facts = list(package.facts)
        rng.shuffle(facts)
        lines = rng.random() < 0.5
    else:
        lines, order = template
        facts = sorted(package.facts, key=lambda fact: order.index(fact[0]))
    if lines:
        return "\n".join([f"Package: {package.name}", *(f"{label.capitalize()}: {value}" for label, value in facts)])
    return f"About {package.name}. " + " ".join(RECORD_SENTENCES[label].format(value=value) for label, value in facts)


def _record_question(package: Package, rng: random.Random) -> tuple[str, str]:
    """A question about one fact of the package, and a short answer to it."""
    label, value = rng.choice(package.facts)
    return RECORD_QUESTIONS[label].format(name=package.name), f"{value}."


def _tool(f: Function) -> dict:
    """An OpenAI tool description of a function (every parameter a string)."""
    params = {p: {"type": "string", "description": p.replace("_", " ")} for p in f.params}
    return {"type": "function", "function": {"name": f.name, "description": f.summary,
                                             "parameters": {"type": "object", "properties": params,
                                                            "required": list(f.params)}}}
