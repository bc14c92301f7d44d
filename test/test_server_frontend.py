"""SGLang's frontend language against the server through `sgl.RuntimeEndpoint`: roles, gen with stop and
max_tokens, select, fork, streaming and run_batch. Greedy text must equal the offline Engine's for the same prompt."""

from __future__ import annotations

import pytest
import requests
import sglang as sgl
from server_utils import start_server, stop_server

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.frontend_lang.warmup import warm_spans
from sglang_pic.managers.io_struct import GenerateReqInput

SYSTEM = "You are a helpful assistant."
ASSISTANT_END = "<|im_end|>\n"  # the chatml template's assistant suffix, appended after the gen
BASE = "Once upon a time there was"


@sgl.function
def chat(s, question):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16, stop="\n", temperature=0))


@sgl.function
def pick(s):
    s += "The quick brown fox" + sgl.select("choice", choices=[" jumps", " sleeps", " runs"])


@sgl.function
def branches(s):
    s += BASE
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" a town number {i} where" + sgl.gen("tail", max_tokens=6, temperature=0, ignore_eos=True)
    forks.join()
    s += " and" + sgl.gen("end", max_tokens=4, temperature=0, ignore_eos=True)


ASK = "USER: I will ask a question based on some statements.\nASSISTANT: Sure.\nUSER: Memorize these statements.\n"
QUESTION = "Now, please answer the following question.\nQuestion: Who is the father of Julian?\nASSISTANT:"
FACTS = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."]


@sgl.function
def parallel_encoding(s, contexts):
    """SGLang's parallel encoding program (its test_programs.test_parallel_encoding, shortened)."""
    s += ASK
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += QUESTION + sgl.gen("answer", max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def backend(tiny_qwen2):
    srv = start_server(tiny_qwen2, "--span-head-tokens", "0")  # the tiny documents stay spans
    runtime = sgl.RuntimeEndpoint(srv.url, chat_template_name="chatml")
    sgl.set_default_backend(runtime)
    yield runtime
    stop_server(srv)


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    with Engine(model_path=str(tiny_qwen2), dtype="float32", max_total_tokens=4096, span_head_tokens=0) as eng:
        yield eng


def engine_text(engine: Engine, prompt: str, **params) -> str:
    return engine.generate(prompt, {"temperature": 0, **params})["text"]


def split_chat(state) -> tuple[str, str]:
    """(the prompt the answer was generated from, the answer), read back from the program's text."""
    answer, full = state["answer"], state.text()
    assert full.endswith(answer + ASSISTANT_END)
    return full[: len(full) - len(answer) - len(ASSISTANT_END)], answer


def test_roles_and_gen_match_engine(backend, engine):
    prompt, answer = split_chat(chat.run(question="What is the capital of France?"))
    assert prompt.startswith("<|im_start|>system\n" + SYSTEM)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "\n" not in answer
    assert answer == engine_text(engine, prompt, max_new_tokens=16, stop="\n")


def test_streaming_gives_same_text(backend):
    whole = chat.run(question="Name a color.")
    streamed = chat.run(question="Name a color.", stream=True)
    assert "".join(streamed.text_iter()) == whole.text()


def test_run_batch(backend, engine):
    questions = ["Name a fruit.", "Count to three.", "Say hi."]
    states = chat.run_batch([{"question": q} for q in questions], num_threads=3)
    for q, state in zip(questions, states):
        prompt, answer = split_chat(state)
        assert q in prompt
        assert answer == engine_text(engine, prompt, max_new_tokens=16, stop="\n")


def test_gen_stop_regex_matches_engine(backend, engine):
    pattern = r"[aeiou][a-z]"

    @sgl.function
    def stopped(s):
        s += BASE + sgl.gen("tail", max_tokens=16, temperature=0, ignore_eos=True, stop_regex=pattern)

    tail = stopped.run()["tail"]
    out = engine.generate(BASE, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop_regex": pattern})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert tail == out["text"]


def test_select(backend):
    state = pick.run()
    assert state["choice"] in (" jumps", " sleeps", " runs")
    assert pick.run()["choice"] == state["choice"]


def test_fork_matches_engine(backend, engine):
    state = branches.run()
    tails = state["tail"]  # join() gathers each fork's variable into a list
    assert len(tails) == 2
    for i, tail in enumerate(tails):
        assert tail == engine_text(engine, f"{BASE} a town number {i} where", max_new_tokens=6, ignore_eos=True)
    assert state.text() == BASE + " and" + state["end"]
    assert state["end"] == engine_text(engine, BASE + " and", max_new_tokens=4, ignore_eos=True)


DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
]


@sgl.function
def rag(s, docs, question):
    s += sgl.system(SYSTEM)
    s += sgl.user("".join(span(d) for d in docs) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0, ignore_eos=True))


def test_span_program_reuses_warmed_spans(backend, engine):
    info = warm_spans(backend, DOCS)
    # The span jobs compute each span once, and the anchor it follows (span_policy.py) at most once each.
    anchor = len(engine.request_builder.span_policy.anchor)
    assert info["num_spans"] == 2 and info["span_tokens"] <= info["computed_tokens"] <= info["span_tokens"] + 2 * anchor
    state = rag.run(docs=DOCS[::-1], question="Where is Paris?")
    meta = state.get_meta_info("answer")
    assert meta["cached_span_tokens"] == info["span_tokens"]  # both spans reused behind a new prefix
    prompt, answer = split_chat(state)
    assert prompt.count("<|ssep|>") == 2
    assert engine_text(engine, prompt, max_new_tokens=8, ignore_eos=True) == answer


@sgl.function
def constrained(s):
    s += "Pick a colour and a count:" + sgl.gen("colour", regex=r"(red|green|blue)", max_tokens=8)
    s += " x" + sgl.gen("count", dtype=int, max_tokens=8)
    s += " as JSON:" + sgl.gen("json", json_schema='{"type": "object", "properties": {"ok": {"type": "boolean"}},'
                               ' "required": ["ok"], "additionalProperties": false}', max_tokens=24)


def test_gen_regex_dtype_and_json_schema(backend):
    """sgl.gen's regex, dtype (a regex the frontend writes) and json_schema constrain the server's output."""
    import json
    import re

    state = constrained.run(temperature=1.0)
    assert state["colour"] in ("red", "green", "blue")
    assert re.fullmatch(r"[-+]?\d+", state["count"]), state["count"]
    assert isinstance(json.loads(state["json"])["ok"], bool)


def test_parallel_encoding_reuses_each_forks_statement(backend, engine):
    """fork + join(mode="concate_and_append"): each fork's statement is a span anchored on the shared prefix, read
    from the KV its fork's commit computed, and the answer equals the same prompt marked so by hand."""
    state = parallel_encoding.run(contexts=FACTS)
    statements = [f"Statement {i}: {fact}\n" for i, fact in enumerate(FACTS)]
    marked = ASK + "".join(span(s, anchor="prefix") for s in statements) + QUESTION  # the server's head: 0
    assert state["answer"] == engine_text(engine, marked, max_new_tokens=8, ignore_eos=True)
    (req,) = engine.make_reqs(GenerateReqInput(text=marked))
    spans = [seg for seg in req.segments if seg.kind == "span"]
    assert len(spans) == 3
    assert state.get_meta_info("answer")["cached_span_tokens"] == sum(len(seg.tokens) for seg in spans)


def test_a_join_without_its_forks_is_refused(backend):
    url = backend.base_url + "/concate_and_append_request"
    for body, named in (({"src_rids": [], "dst_rid": "d"}, "src_rids"), ({"src_rids": "a"}, "src_rids"),
                        ({"src": ["a"]}, "unknown field: src")):
        reply = requests.post(url, json=body)
        assert reply.status_code == 400 and named in reply.text, reply.text
