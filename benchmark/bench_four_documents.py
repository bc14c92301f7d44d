"""The four-document question a new user asks: spans against plain concatenation on the embedded model.

Four short biographies (each padded to about 100 tokens with the same town description, so the facts that tell
them apart sit in the spans' first tokens) and one question per person, sent as one chat prompt per question:
the documents joined by blank lines, as spans with the server's default span settings, and as isolated spans.
Prints the answers that name the right fact and the span tokens each request reused.

Usage: python benchmark/bench_four_documents.py [--model-path M]
"""

from __future__ import annotations

import argparse

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span

TOWN = (" The town has a harbour, a market square, an old library, two bridges over the river, a school, a small"
        " museum of local history, several cafes and a park where people walk their dogs in the evening.")
DOCS = [
    "Marta Olsen is a marine biologist who lives in Bergen and studies cod migration.",
    "Kenji Sato is a violin maker who lives in Kyoto and restores old instruments.",
    "Amara Obi is an architect who lives in Lagos and designs solar-powered schools.",
    "Luis Ortega is a baker who lives in Seville and is famous for orange bread.",
]
QUESTIONS = [("Where does Kenji Sato live?", "kyoto"), ("What does Amara Obi design?", "school"),
             ("What is Luis Ortega famous for?", "orange"), ("What does Marta Olsen study?", "cod")]
WAYS = {  # name -> (how the documents are joined, Engine.generate's span settings)
    "concatenated": (lambda docs: "".join(d + "\n\n" for d in docs), {}),
    "spans, default settings": (lambda docs: "".join(span(d + "\n\n") for d in docs), {}),
    "spans, isolated": (lambda docs: "".join(span(d + "\n\n") for d in docs),
                        {"span_anchor": "none", "span_head_tokens": 0}),
}


def chat(body: str) -> str:
    return ("<|im_start|>system\nAnswer briefly from the documents.<|im_end|>\n<|im_start|>user\n" + body
            + "<|im_end|>\n<|im_start|>assistant\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", help="default: the embedded Qwen2.5-Coder-0.5B-Instruct")
    args = p.parse_args()
    docs = [d + TOWN + TOWN for d in DOCS]
    with Engine(model_path=args.model_path, dtype="float32") as engine:
        for name, (join, settings) in WAYS.items():
            outs = engine.generate([chat(join(docs) + q) for q, _ in QUESTIONS],
                                   {"temperature": 0, "max_new_tokens": 16}, **settings)
            right = sum(gold in o["text"].lower() for o, (_, gold) in zip(outs, QUESTIONS))
            reused = [o["meta_info"]["cached_span_tokens"] for o in outs]
            print(f"{name:<24} {right}/{len(QUESTIONS)} right, span tokens reused per request {reused}")
            for o in outs:
                print(f"    {o['text']!r}")


if __name__ == "__main__":
    main()
