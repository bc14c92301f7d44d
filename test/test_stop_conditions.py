"""Stop strings and stop regexes: the earliest stop in the output ends it and is cut off, `^` means the output's
start even when only a window of it is searched, and a stream never shows text that a stop later takes back."""

from __future__ import annotations

import random
import re

import pytest
from sglang_pic import Engine
from sglang_pic.sampling.stop_conditions import StopConditions
from sglang_pic.tokenizer import load_tokenizer

PROMPT = "Once upon a time there was a little town"
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def test_search_finds_the_earliest_stop():
    stops = StopConditions.build(["cd", "b"], ["c.", r"x\d"], None)
    assert stops.search("abcdx1") == stops.search("abcdx1", 0)
    assert (stops.search("abcdx1").stop, stops.search("abcdx1").start) == ("b", 1)
    assert stops.search("zzcdx1").stop == "cd"  # a tie goes to the first listed
    assert stops.search("zzx1cd").stop == r"x\d"
    assert stops.search("b", 1) is None


def test_window_bounds_the_longest_stop():
    assert StopConditions.build(["abc"], ["x{2,5}"], None).window == 6  # 5 characters, plus a context token
    assert StopConditions.build(["abc"], ["x+"], None).window is None  # unbounded: the whole output
    assert StopConditions.build([], [], None) is None


def test_hold_back_keeps_what_could_grow_into_a_stop():
    stops = StopConditions.build(["</answer>"], [], None)
    assert stops.hold_back("the answer</ans") == 5
    assert stops.hold_back("the answer<") == 1
    assert stops.hold_back("the answer") == 0
    regexes = StopConditions.build([], [r"\d{3}-\d{4}", "and|or"], None)
    assert regexes.hold_back("call 555-12") == 6
    assert regexes.hold_back("cats an") == 2
    assert regexes.hold_back("555-1234 then") == 0  # a whole match already let pass (min_new_tokens) is not held


def random_stops(rng: random.Random) -> tuple[StopConditions, str]:
    alphabet = "ab c."
    strings = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 2))]
    patterns = [r"a+b", r"c\.", r"b{2}", r"\.a", r"(ab|ba)c", r"a.c", r"^ab", r"(?<=c)a", r"\bab"]
    chosen = rng.sample(patterns, rng.randint(0 if strings else 1, 2))
    return StopConditions.build(strings, chosen, None), "".join(rng.choice(alphabet) for _ in range(30))


def scheduled_stop(stops: StopConditions, text: str, windowed: bool) -> tuple[int | None, str]:
    """What the scheduler does with `text` arriving one character (token) at a time: the step it stops at, if
    any, and the final text."""
    for n in range(1, len(text) + 1):
        whole = not windowed or stops.window is None or n <= stops.window
        tail = text[:n] if whole else text[n - stops.window : n]
        match = stops.search(tail, 0 if whole else 1)
        if match is not None:
            return n, text[: n - (len(tail) - match.start)]
    return None, text


def test_window_search_equals_whole_output_search_on_random_text():
    rng = random.Random(2)
    for _ in range(2000):
        stops, text = random_stops(rng)
        assert scheduled_stop(stops, text, windowed=True) == scheduled_stop(stops, text, windowed=False), text


def test_streamed_text_is_always_a_prefix_of_the_final_text_on_random_text():
    rng = random.Random(1)
    for _ in range(2000):
        stops, text = random_stops(rng)
        stop_at, final = scheduled_stop(stops, text, windowed=True)
        for n in range(1, stop_at or len(text) + 1):
            shown = text[: n - stops.hold_back(text[:n])]
            assert final.startswith(shown), (stops, text[:n], shown, final)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine, tiny_llama):
    """The unstopped greedy output, its text, and the text of each of its prefixes."""
    out = engine.generate(PROMPT, GREEDY)
    tok = load_tokenizer(str(tiny_llama))
    prefixes = [tok.decode(out["output_ids"][:i], skip_special_tokens=True) for i in range(len(out["output_ids"]) + 1)]
    assert prefixes[-1] == out["text"]
    return out["output_ids"], out["text"], prefixes


def spanning_stop(prefixes: list[str], text: str) -> str:
    """A piece of the output that starts in one token's text and ends two tokens later."""
    for k in range(8, len(prefixes) - 3):
        start, end = len(prefixes[k]) - 1, len(prefixes[k + 2]) + 1
        stop = text[start:end]
        if len(prefixes[k + 2]) > len(prefixes[k]) > 0 and "\ufffd" not in stop and text.find(stop) == start:
            return stop
    raise AssertionError("no stop candidate in the reference output")


def first_token_with(prefixes: list[str], stop: str) -> int:
    return next(i for i, p in enumerate(prefixes) if stop in p)


@pytest.mark.parametrize("kind", ["stop", "stop_regex"])
def test_stop_ends_and_cuts_the_output(engine, reference, kind):
    ids, text, prefixes = reference
    stop = spanning_stop(prefixes, text)
    asked = stop if kind == "stop" else re.escape(stop)
    out = engine.generate(PROMPT, {**GREEDY, kind: asked})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": asked}
    n = first_token_with(prefixes, stop)
    assert out["output_ids"] == ids[:n]
    assert out["text"] == text[: text.find(stop)]

    kept = engine.generate(PROMPT, {**GREEDY, kind: asked, "no_stop_trim": True})
    assert kept["text"] == prefixes[n]


@pytest.mark.parametrize("kind", ["stop", "stop_regex"])
def test_stream_never_shows_what_a_stop_cuts(engine, reference, kind):
    ids, text, prefixes = reference
    stop = spanning_stop(prefixes, text)
    asked = stop if kind == "stop" else re.escape(stop)
    chunks = list(engine.generate(PROMPT, {**GREEDY, kind: asked}, stream=True))
    final = chunks[-1]["text"]
    assert final == text[: text.find(stop)]
    assert len(chunks) >= 3
    for chunk in chunks:
        assert final.startswith(chunk["text"]), (chunk["text"], final)


def test_caret_means_the_output_start(engine, reference):
    ids, text, prefixes = reference
    first = engine.generate(PROMPT, {**GREEDY, "stop_regex": "^" + re.escape(text[0])})
    assert first["meta_info"]["finish_reason"]["type"] == "stop"
    assert first["text"] == "" and len(first["output_ids"]) == first_token_with(prefixes, text[0])
    later = next(c for c in text[len(prefixes[4]) :] if c != text[0] and c != "\ufffd")
    out = engine.generate(PROMPT, {**GREEDY, "stop_regex": "^" + re.escape(later)})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == ids


def test_earliest_of_several_stops_wins(engine, reference):
    ids, text, prefixes = reference
    stop = spanning_stop(prefixes, text)
    later = text[text.find(stop) + len(stop) :][:2]
    out = engine.generate(PROMPT, {**GREEDY, "stop": [later], "stop_regex": [re.escape(stop)]})
    assert out["meta_info"]["finish_reason"]["matched"] == re.escape(stop)
    assert out["text"] == text[: text.find(stop)]


@pytest.mark.timeout(600)  # without the search's time limit this request would backtrack forever: a hang
def test_a_pattern_that_backtracks_forever_aborts_only_its_request(engine, reference):
    """`(.|.)+c$` backtracks exponentially on text holding a `c` that does not end it: the search runs out of time
    and that request is aborted, naming the cause, while its neighbour runs to the end."""
    ids, text, prefixes = reference
    c = next(ch for ch in text if ch != "\ufffd" and not any(p.endswith(ch) for p in prefixes))
    slow = {**GREEDY, "stop_regex": "(.|.)+" + re.escape(c) + "$"}
    outs = engine.generate([PROMPT, PROMPT], [slow, GREEDY])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "stop_regex search took over" in reason["message"]
    assert outs[1]["output_ids"] == ids


@pytest.mark.timeout(300)  # the unbounded search would take about fib(60) steps: a hang
def test_search_gives_up_on_catastrophic_backtracking():
    stops = StopConditions.build([], [r"(a|aa)+$"], None)
    with pytest.raises(TimeoutError):
        stops.search("a" * 60 + "!")
    assert stops.hold_back("a" * 60 + "!") == 0
