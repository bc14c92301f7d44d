"""The prompts a span-quality run sends: every item rendered once through the server's own chat rendering (earlier
turns included; tools as spans, as with `tool_spans: true`) and tokenized by the engine's segmenter, so the dense
and the span prompts are the same token ids."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_pic.entrypoints.chat_template import load_chat_template, render_chat
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest
from sglang_pic.entrypoints.tool_calls import tool_call_parser
from sglang_pic.frontend_lang.markers import strip_markers
from sglang_pic.managers.request_builder import RequestBuilder
from sglang_pic.model_config import ModelConfig
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_quality.items import Item, item_seed
from sglang_pic.span_quality.sizes import TaskSizes
from sglang_pic.span_quality.tasks import Task
from sglang_pic.tokenizer import load_tokenizer


@dataclass(frozen=True)
class Prompt:
    marked: str  # the rendered chat prompt, documents (and tools) marked as spans
    ids: list[int]  # the engine's token ids for it: the dense prompt
    plain_ids_match: bool  # whether tokenizing strip_markers(marked) whole gives `ids` too
    span_tokens: int  # tokens of its span segments: documents and tools


class PromptBuilder:
    """Renders items as the server's chat route does and tokenizes them as the engine does, without a model."""

    def __init__(self, model_dir: str, tokenizer_dir: str, chat_template: str | None) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_dir, tokenizer_path=tokenizer_dir,
                                           chat_template=chat_template)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        config = ModelConfig.from_server_args(model_dir, self.args, device="cpu")
        self.request_builder = RequestBuilder(self.args, self.tokenizer, config)
        self.chat_template = load_chat_template(chat_template, self.tokenizer)
        self.tool_parser = tool_call_parser(self.args.tool_call_parser, config.architecture)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, item: Item) -> Prompt:
        turns = [{"role": t.role, "content": t.content} for t in item.earlier]
        body = ChatCompletionRequest(
            messages=[{"role": "system", "content": item.system}, *turns, {"role": "user", "content": item.user}],
            tools=list(item.tools) or None,
            tool_spans=bool(item.tools),
        )
        marked = render_chat(body, self.tokenizer, self.chat_template, self.args)
        segments = self.request_builder.tokenize(marked)
        ids = [t for seg in segments for t in seg.token_ids]
        plain = self.tokenizer(strip_markers(marked), add_special_tokens=True)["input_ids"]
        spans = sum(len(seg.token_ids) for seg in segments if seg.kind == "span")
        return Prompt(marked, ids, list(plain) == ids, spans)

    def tool_calls(self, item: Item, reply: str) -> list:
        if not item.tools or self.tool_parser is None:
            return []
        return self.tool_parser.parse(reply, {t["function"]["name"] for t in item.tools})[1]


@dataclass(frozen=True)
class Workload:
    """Each task's items of one split (items.SPLITS) and their prompts."""

    tasks: dict[str, Task]
    split: str
    items: dict[str, list[Item]]
    prompts: dict[str, list[Prompt]]

    @classmethod
    def build(cls, tasks: dict[str, Task], samples: int, seed: int, sizes: TaskSizes,
              builder: PromptBuilder, split: str) -> Workload:
        items = {t: task.make(samples, item_seed(seed, t, split), sizes, builder.count) for t, task in tasks.items()}
        return cls(tasks, split, items, {t: [builder.build(it) for it in items[t]] for t in tasks})

    def requests(self) -> int:
        return sum(len(v) for v in self.items.values())
