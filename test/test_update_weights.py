"""update_weights_from_disk: another checkpoint of the served model, loaded in place; the cache is dropped (its KV
came from the old weights), a wrong or broken checkpoint is refused with the old weights kept, and on the server
requests in flight finish with the old weights while new ones wait for the new."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from server_utils import start_server, stop_server

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span

PROMPT = "Read this." + span("The capital of France is Paris, the capital of Japan is Tokyo.") + "Where is Paris?"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def variant(src: Path, dst: Path, drop: str | None = None) -> Path:
    """A copy of checkpoint `src` with other weights (every tensor perturbed), or with tensor `drop` missing."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    tensors = {name: t + 0.2 * torch.randn(t.shape, generator=gen) for name, t in tensors.items() if name != drop}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {
        "a": Path(tiny_llama),
        "b": variant(Path(tiny_llama), root / "b"),
        "broken": variant(Path(tiny_llama), root / "broken", drop="model.layers.1.mlp.down_proj.weight"),
    }


def outputs(path: Path, **kwargs) -> list[int]:
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=2048, **kwargs) as engine:
        return engine.generate(PROMPT, GREEDY)["output_ids"]


def test_engine_serves_the_new_weights_and_drops_the_cache(checkpoints, tiny_qwen2):
    want_a, want_b = outputs(checkpoints["a"]), outputs(checkpoints["b"])
    assert want_a != want_b
    with Engine(model_path=str(checkpoints["a"]), dtype="float32", max_total_tokens=2048) as engine:
        assert engine.generate(PROMPT, GREEDY)["output_ids"] == want_a
        assert engine.generate(PROMPT, GREEDY)["meta_info"]["cached_tokens"] > 0
        refused = [
            (str(tiny_qwen2), "not the served model's architecture: architecture 'Qwen2ForCausalLM'"),
            (str(checkpoints["a"].parent / "nowhere"), "cannot read"),
            (str(checkpoints["broken"]), "the previous weights are back"),
        ]
        for path, message in refused:
            ok, why = engine.update_weights_from_disk(path)
            assert not ok and message in why, why
            assert engine.generate(PROMPT, GREEDY)["output_ids"] == want_a  # the broken one was loaded back out
        stream = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 50}, stream=True)
        next(stream)
        ok, why = engine.update_weights_from_disk(str(checkpoints["b"]))
        assert not ok and "requests are running" in why
        stream.close()
        ok, why = engine.update_weights_from_disk(str(checkpoints["b"]))
        assert ok, why
        out = engine.generate(PROMPT, GREEDY)
        assert out["output_ids"] == want_b and out["meta_info"]["cached_tokens"] == 0  # no KV of the old weights
        assert engine.get_model_info()["model_path"] == str(checkpoints["b"])


def test_every_tensor_parallel_rank_loads_its_shard(checkpoints):
    """tp_size 2 on CPU: rank 0 tells the follower to load its shard; a checkpoint one rank cannot load is undone
    on both."""
    want_a, want_b = outputs(checkpoints["a"]), outputs(checkpoints["b"])
    with Engine(model_path=str(checkpoints["a"]), dtype="float32", max_total_tokens=2048, tp_size=2) as engine:
        ok, why = engine.update_weights_from_disk(str(checkpoints["broken"]))
        assert not ok and "previous weights are back" in why
        assert engine.generate(PROMPT, GREEDY)["output_ids"] == want_a
        ok, why = engine.update_weights_from_disk(str(checkpoints["b"]))
        assert ok, why
        assert engine.generate(PROMPT, GREEDY)["output_ids"] == want_b


def test_failed_update_of_dummy_weights_restores_them(checkpoints):
    with Engine(model_path=str(checkpoints["a"]), dtype="float32", max_total_tokens=2048, load_format="dummy") as e:
        before = e.generate(PROMPT, GREEDY)["output_ids"]
        ok, why = e.update_weights_from_disk(str(checkpoints["broken"]))
        assert not ok and "lacks" in why
        assert e.generate(PROMPT, GREEDY)["output_ids"] == before


@pytest.mark.slow  # a server and a long request: most of a minute
def test_server_update_waits_for_running_requests_and_holds_new_ones(checkpoints):
    """A long request in flight finishes with the old weights; a request sent while the update waits runs with the
    new; bad bodies and wrong checkpoints are 400s with the reason."""
    want_a, want_b = outputs(checkpoints["a"]), outputs(checkpoints["b"])
    long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    with Engine(model_path=str(checkpoints["a"]), dtype="float32", max_total_tokens=2048) as engine:
        long_a = engine.generate(PROMPT, long)["output_ids"]
    srv = start_server(checkpoints["a"])
    try:
        bad = srv.post("/update_weights_from_disk", json={"path": "x"})
        assert bad.status_code == 400 and "model_path" in bad.json()["message"]
        wrong = srv.post("/update_weights_from_disk", json={"model_path": str(checkpoints["broken"])})
        assert wrong.status_code == 400 and "previous weights are back" in wrong.json()["message"]
        results: dict[str, object] = {}
        stream = srv.post("/generate", json={"text": PROMPT, "sampling_params": long, "stream": True}, stream=True)
        lines = stream.iter_lines(decode_unicode=True)
        next(line for line in lines if line.startswith("data: "))  # the long request is running
        update = threading.Thread(target=lambda: results.update(
            update=srv.post("/update_weights_from_disk", json={"model_path": str(checkpoints["b"])})
        ))
        update.start()
        time.sleep(0.05)  # the update reaches the scheduler first and waits behind the long request
        late = srv.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
        events = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        update.join(60)
        assert results["update"].status_code == 200 and results["update"].json()["success"]
        assert json.loads(events[-1][6:])["output_ids"] == long_a
        assert late["output_ids"] == want_b and want_b != want_a
        assert srv.get("/get_server_info").json()["model_path"] == str(checkpoints["b"])
    finally:
        stop_server(srv)
