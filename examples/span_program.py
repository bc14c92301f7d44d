"""An SGLang program whose documents are spans: prefilled once, reused behind any prompt and in any order.

    python -m sglang_pic.launch_server --port 30000 &
    python examples/span_program.py http://127.0.0.1:30000
"""

import sys

import sglang as sgl

from sglang_pic.frontend_lang.markers import span
from sglang_pic.frontend_lang.warmup import warm_spans

DOCS = [
    "Kiroku is a small software company that makes a note-taking app for researchers. It was founded in 2015 in "
    "Kyoto by Mei Tanaka, who was born in Lyon, France, and moved to Japan to study computer science. The company "
    "has 40 employees, most of them engineers, and its app stores notes as plain text files so that they can be "
    "read without it. In 2021 Kiroku opened a second office in Osaka, close to two universities whose labs use "
    "the app. The next year it released a version for tablets that can sync notes between devices without any "
    "server, and it now sells yearly licences to libraries and research institutes in twelve countries. Its "
    "engineers meet once a month with the scientists who use the app most, and every feature of the last three "
    "releases, from the citation search to the shared notebooks, started as a request made at one of those meetings.",
    "Brightleaf is a solar panel company based in Porto, Portugal. Alice Martin founded it in 2009 after ten years "
    "as an electrical engineer at a power utility. Brightleaf designs panels for the roofs of old buildings, where "
    "weight limits rule out standard panels, and it employs about 300 people. Most of its panels are sold in Spain "
    "and Portugal, and the company plans to open a factory in Braga. Its panels are lighter than most because "
    "they use a thin glass front and an aluminium frame, and each one comes with a twenty-year warranty. In 2022 "
    "Brightleaf won a national prize for fitting panels to the roof of a nineteenth-century market hall in Lisbon. "
    "The company also trains roofers to install its panels, runs a repair service for them, and buys old panels back "
    "so that their glass and aluminium can be recycled at a plant it shares with two other manufacturers near Aveiro.",
]


@sgl.function
def ask(s, docs, question):
    s += sgl.system("Answer from the documents in one sentence.")
    s += sgl.user("".join(span(doc) for doc in docs) + question)  # each document is a reusable span
    s += sgl.assistant(sgl.gen("answer", max_tokens=32, temperature=0))


backend = sgl.RuntimeEndpoint(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000")
sgl.set_default_backend(backend)
warm_spans(backend, DOCS)  # optional: prefill the documents before the questions arrive
QUESTIONS = [(DOCS, "Who founded Kiroku, and where was that person born?"),
             (DOCS[::-1], "How many people work at Brightleaf?")]
for docs, question in QUESTIONS:  # the same spans, in another order, behind another question
    state = ask.run(docs=docs, question=question)
    print(state["answer"].strip(), "| span tokens reused:", state.get_meta_info("answer")["cached_span_tokens"])
