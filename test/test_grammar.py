"""Constrained decoding: json_schema, regex and EBNF outputs stay inside their language, under overlap scheduling
too, and a constrained request leaves its unconstrained neighbours' tokens alone."""

from __future__ import annotations

import json
import re

import pytest

from sglang_pic import Engine
from test_engine import PROMPTS

ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["answer", "colour"],
    "additionalProperties": False,
}
CONSTRAINED = [
    {"json_schema": json.dumps(ANSWER)},
    {"regex": r"(red|green|blue) [0-9]{2}"},
    {"ebnf": 'root ::= "The answer is " ("yes" | "no") "."'},
]
# SGLang's structural tag: free text, but what follows a trigger must complete a structure.
TAGGED = {"structural_tag": json.dumps({
    "structures": [{"begin": "<pick>", "schema": {"enum": ["red", "blue"]}, "end": "</pick>"}], "triggers": ["<pick>"],
})}
FREE = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def engine_for(model, overlap: bool = True, jump_forward: bool = False) -> Engine:
    return Engine(
        model_path=str(model), dtype="float32", max_total_tokens=2048, disable_overlap_schedule=not overlap,
        enable_jump_forward=jump_forward,
    )


def check(constraint: dict, text: str) -> None:
    if "json_schema" in constraint:
        out = json.loads(text)
        assert out["answer"] in ("yes", "no") and out["colour"] in ("red", "green", "blue") and len(out) == 2
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    else:
        assert text in ("The answer is yes.", "The answer is no."), text


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_outputs_stay_in_their_language(tiny_llama, overlap):
    params = [{"temperature": t, "max_new_tokens": 64, "seed": 3, **c} for c in CONSTRAINED for t in (0, 1.0)]
    prompts = (PROMPTS * 2)[: len(params)]
    with engine_for(tiny_llama, overlap) as engine:
        outs = engine.generate(prompts + [PROMPTS[0]], params + [FREE])
        alone = engine.generate(PROMPTS[0], FREE)
    for p, out in zip(params, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        check(p, out["text"])
    assert outs[-1]["output_ids"] == alone["output_ids"]  # the free neighbour is not masked


def test_overlap_scheduling_gives_the_same_constrained_tokens(tiny_llama):
    params = [{"temperature": 0.8, "max_new_tokens": 64, "seed": 5, **c} for c in CONSTRAINED] + [FREE]
    runs = []
    for overlap in (False, True):
        with engine_for(tiny_llama, overlap) as engine:
            runs.append([o["output_ids"] for o in engine.generate((PROMPTS * 2)[: len(params)], params)])
    assert runs[0] == runs[1]


def test_constrained_step_commits_behind_the_next_forward(tiny_llama):
    """The step in flight is committed after the next step's forward is launched (only its sampling waits for the
    grammars), so constrained decoding keeps the overlap."""
    events = []
    with engine_for(tiny_llama) as engine:
        sched = engine.scheduler
        forward, commit = sched.runner.forward_local, sched.finishing.commit

        def record_forward(batch):
            logits = forward(batch)
            events.append("forward")
            return logits

        def record_commit(step):
            events.append("commit")
            return commit(step)

        sched.runner.forward_local, sched.finishing.commit = record_forward, record_commit
        out = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 64, **CONSTRAINED[0]})
    check(CONSTRAINED[0], out["text"])
    steps = out["meta_info"]["completion_tokens"]
    assert steps > 3
    # the prefill, then each decode's forward goes out before the step before it is committed
    assert events[:7] == ["forward"] + ["forward", "commit"] * 3
    assert events.count("commit") == steps


def test_jump_forward_prefills_forced_text_in_one_step(tiny_llama):
    """With jump-forward, text the grammar forces (the JSON keys and punctuation, the EBNF's fixed words) is
    appended as tokens and prefilled in one step: outputs stay in their language in far fewer decode steps, the
    same with overlap on and off, and an unconstrained neighbour is untouched."""
    params = [{"temperature": t, "max_new_tokens": 64, "seed": 3, **c} for c in CONSTRAINED for t in (0, 1.0)]
    prompts = (PROMPTS * 2)[: len(params)] + [PROMPTS[0]]
    runs = {}
    for overlap, jump in ((True, False), (True, True), (False, True)):
        with engine_for(tiny_llama, overlap, jump) as engine:
            outs = engine.generate(prompts, params + [FREE])
            runs[overlap, jump] = outs, engine.scheduler.stats.num_decode_steps, engine.scheduler.stats.num_steps
            assert not engine.scheduler.jumping
            assert (engine.get_stats()["jump_forward_tokens"] > 0) == jump
    plain, jumped = runs[True, False], runs[True, True]
    for p, out in zip(params, jumped[0]):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        check(p, out["text"])
    assert jumped[0][-1]["output_ids"] == plain[0][-1]["output_ids"]
    assert [o["output_ids"] for o in jumped[0]] == [o["output_ids"] for o in runs[False, True][0]]
    assert jumped[2] < plain[2] * 0.6, (jumped[2], plain[2])  # steps: the JSON schema forces most of its text


@pytest.mark.timeout(120)  # all running requests jumping with no room for their forced tokens used to deadlock
def test_jump_forward_under_a_small_pool_retracts_and_keeps_tokens(tiny_llama):
    """Jumping requests need room for their forced tokens; when every running request is jumping, room is made by
    retraction (no deadlock), and the outputs equal those of a pool with room for everyone."""
    forced = (
        r"The answer is (yes|no)\. Let me explain the reasoning in some detail now: [a-z ]{20,30}\. "
        r"That is all for today\."
    )
    params = {"temperature": 0, "max_new_tokens": 120, "regex": forced}
    prompts = [f"{p} number {i}" for i, p in enumerate(PROMPTS * 4)][:8]
    with engine_for(tiny_llama, jump_forward=True) as big:
        expected = [o["output_ids"] for o in big.generate(prompts, params)]
    with Engine(
        model_path=str(tiny_llama), dtype="float32", max_total_tokens=256, page_size=4, chunked_prefill_size=32,
        enable_jump_forward=True,
    ) as small:
        outs = small.generate(prompts, params)
        assert small.scheduler.stats.num_retractions > 0
        assert not small.scheduler.jumping and small.scheduler.is_idle()
    assert [o["output_ids"] for o in outs] == expected
    for out in outs:
        assert re.fullmatch(forced, out["text"]), out["text"]


def test_closing_a_jumping_stream_frees_everything(tiny_llama):
    """A stream closed while its request has forced tokens queued aborts it, leaves no pending jump, and the pool
    is whole again."""
    params = {"temperature": 0, "max_new_tokens": 64, **CONSTRAINED[0]}
    with engine_for(tiny_llama, jump_forward=True) as engine:
        sched = engine.scheduler
        stream = engine.generate(PROMPTS[0], params, stream=True)
        for chunk in stream:
            if sched.jumping:
                break
        assert sched.jumping and chunk["meta_info"]["finish_reason"] is None
        stream.close()
        assert not sched.jumping and not sched.running
        assert engine.get_stats()["token_usage"] == 0


def test_structural_tag_constrains_what_follows_its_trigger(tiny_llama):
    """Text is free until a trigger; then the structure's schema and end tag must follow."""
    from transformers import AutoTokenizer

    from sglang_pic.sampling.grammar import GrammarBackend
    from sglang_pic.sampling.sampling_params import SamplingParams

    backend = GrammarBackend(AutoTokenizer.from_pretrained(tiny_llama), 384)

    def accepts(text: str) -> bool:
        return backend.matcher(SamplingParams(**TAGGED)).accept_string(text)

    assert accepts("any words at all <pick>") and accepts('then <pick>"red"</pick> and more')
    assert not accepts('<pick>"green"') and not accepts('<pick>"red" </pick>')
    with engine_for(tiny_llama) as engine:
        out = engine.generate("Choose:", {"temperature": 1.0, "seed": 1, "max_new_tokens": 8, **TAGGED})
    assert out["meta_info"]["completion_tokens"] >= 1


def test_bad_grammars_are_refused_with_the_reason(tiny_llama):
    with engine_for(tiny_llama) as engine:
        for params, needle in (
            ({"json_schema": '{"type": "object",'}, "json_schema is not valid"),
            ({"regex": "(a|b"}, "regex is not valid"),
            ({"ebnf": "root ::= undefined_rule"}, "ebnf is not valid"),
            ({"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}'}, "structural_tag is not"),
        ):
            with pytest.raises(ValueError, match=needle):
                engine.generate("hi", params)
        assert engine.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
