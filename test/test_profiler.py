"""torch.profiler runs over scheduler steps: Engine.start_profile / stop_profile (the server's routes are tested in
test_server_native)."""

from __future__ import annotations

import gzip
import json

import pytest

from sglang_pic import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as e:
        yield e


def _event_names(path: str) -> set[str]:
    return {event.get("name", "") for event in json.loads(gzip.open(path).read())["traceEvents"]}


def test_a_profile_records_the_steps_between_start_and_stop(engine, tmp_path):
    path = engine.start_profile(str(tmp_path), activities=["CPU"])
    assert path.startswith(str(tmp_path)) and path.endswith(".trace.json.gz")
    engine.generate("The quick brown fox", GREEDY)
    assert engine.stop_profile() == path
    assert any(name.startswith("aten::") for name in _event_names(path))  # the forward's operators


def test_a_profile_of_num_steps_stops_by_itself(engine, tmp_path):
    path = engine.start_profile(str(tmp_path), num_steps=2, activities=["CPU"], record_shapes=True)
    engine.generate("Once upon a time", GREEDY)  # more than two steps
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()
    assert _event_names(path)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(activities=["TPU"]), "activities"),
        (dict(activities=[]), "activities"),
        (dict(activities="CPU"), "activities"),
        (dict(num_steps=0), "num_steps"),
        (dict(num_steps=True), "num_steps"),
        (dict(output_dir="/proc/no/such/place"), "cannot write traces"),
    ],
)
def test_bad_profile_arguments_are_refused(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.start_profile(**kwargs)
    with pytest.raises(ValueError, match="no profile is running"):  # nothing was left running
        engine.stop_profile()


def test_a_second_start_is_refused_while_one_runs(engine, tmp_path):
    path = engine.start_profile(str(tmp_path), activities=["CPU"])
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile(str(tmp_path))
    assert engine.stop_profile() == path
