"""Span adapters (span_adapter/, model_loader/span_adapter.py, train_span_adapter.py) on a tiny model.

The central check: the student that training runs (the HF model plus LoRA, on the span layout with its mask and
positions) gives the logits the engine serves for the same span prompt with the adapter merged (`span_adapter`),
under every span setting training draws from and under full attention. So what the adapter learns is what the
engine will run.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_models import default_model_installed

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.model_loader.span_adapter import SpanAdapter, load_adapter, merged_weights, save_adapter
from sglang_pic.server_args import ServerArgs
from sglang_pic.span_adapter.layout import SpanLayout, segments_layout
from sglang_pic.span_adapter.lora import add_lora, lora_off, to_adapter
from sglang_pic.span_adapter.trainer import layout_logits
from sglang_pic.train_span_adapter import main as train_main, parse_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from make_adapter import random_adapter  # noqa: E402

DOCS = [
    "The capital of France is Paris, the capital of Japan is Tokyo.",
    "A serving engine batches requests and streams tokens back to each client.",
    "In the morning we walked to the market and bought fresh bread and apples.",
]
PROMPT = "Answer the question." + span(DOCS[0]) + span(DOCS[1]) + span(DOCS[2]) + "Where is Paris?"
NEW = 5
SETTINGS = {
    "anchor": {"span_anchor": "auto", "span_head_tokens": 0},
    "isolated": {"span_anchor": "none", "span_head_tokens": 0},
    "anchor+head": {"span_anchor": "auto", "span_head_tokens": 3},
    "anchor+tail": {"span_anchor": "auto", "span_head_tokens": 0, "span_tail_tokens": 3},
    "anchor+lexical": {"span_anchor": "auto", "span_head_tokens": 0, "span_query_share": 0.1, "span_select": "lexical"},
}


@pytest.fixture(scope="module")
def adapted(tiny_qwen2, tmp_path_factory):
    """The tiny model with LoRA factors drawn at random (B nonzero, so the adapter changes every answer), that
    adapter saved, and two engines serving it: apart from the weights, to requests that keep a span (the default
    scope), and merged into them (scope all)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    layers = add_lora(model, rank=4, alpha=8.0)
    gen = torch.Generator().manual_seed(0)
    for layer in layers.values():
        layer.lora_B.data.normal_(0.0, 0.05, generator=gen)
    folder = tmp_path_factory.mktemp("adapter")
    save_adapter(folder, to_adapter(layers, 4, 8.0, {"span_settings": SETTINGS["anchor+head"]}), str(tiny_qwen2))
    engines = {scope: Engine(model_path=str(tiny_qwen2), dtype="float32", max_total_tokens=4096,
                             span_adapter=str(folder), span_adapter_scope=scope) for scope in ("spans", "all")}
    yield model, layers, folder, engines
    for engine in engines.values():
        engine.shutdown()


def student_greedy(model, layout: SpanLayout, n: int) -> tuple[list[int], list[float]]:
    flat = SpanLayout(list(layout.ids), list(layout.positions), list(layout.scope), list(layout.visible))
    tokens, logps = [], []
    for _ in range(n):
        with torch.no_grad():
            logits = layout_logits(model, [flat])[0][-1]
        tok = int(logits.argmax())
        tokens.append(tok)
        logps.append(float(torch.log_softmax(logits, -1)[tok]))
        flat.append_output([tok])
    return tokens, logps


def served(engine: Engine, prompt, given: dict) -> tuple[list[int], list[float]]:
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    kwargs = {"input_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    out = engine.generate(**kwargs, sampling_params=params, return_logprob=True, **given)
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize(("name", "scope"), [(name, "spans") for name in SETTINGS] + [("anchor+head", "all")])
def test_training_layout_equals_the_engine_with_the_adapter(adapted, name, scope):
    """Apart from the weights or merged into them, a span prompt runs under the adapter as training ran it."""
    model, _, _, engines = adapted
    engine = engines[scope]
    given = SETTINGS[name]
    layout = segments_layout(engine.make_reqs(GenerateReqInput(text=PROMPT, **given))[0].segments)
    if "span_select" in given:  # the span naming Paris is recomputed in context: fewer tokens under span scope
        anchor = segments_layout(engine.make_reqs(GenerateReqInput(text=PROMPT, **SETTINGS["anchor"]))[0].segments)
        assert sum(s is not None for s in layout.scope) < sum(s is not None for s in anchor.scope)
    want_tokens, want_logps = student_greedy(model, layout, NEW)
    for _ in range(2):  # cold, then with every span cached
        tokens, logps = served(engine, PROMPT, given)
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logps), torch.tensor(want_logps), atol=2e-4, rtol=1e-4)


def test_a_padded_batch_holds_each_layouts_mask():
    """The batch mask, built on the device: each layout's own mask in its corner, padding rows seeing only
    themselves and no real row seeing padding."""
    from sglang_pic.span_adapter.trainer import PAD_MULTIPLE, _pad_batch

    long, short = SpanLayout(), SpanLayout()
    long.add([1, 2, 3], 0, None, True)
    long.add([4, 5], 1, 0, False)  # a hidden copy, then its span piece
    long.add([6, 7, 8], 3, 0, True)
    long.add([9, 10], 6, None, True)
    short.add([1, 2], 0, None, True)
    short.add([6, 7], 2, 1, True)
    ids, pos, mask = _pad_batch([long, short], torch.device("cpu"))
    n = PAD_MULTIPLE  # both padded to one multiple: never a length of 64 mod 128
    assert mask.shape == (2, 1, n, n) and ids[1, 4:].tolist() == [0] * (n - 4)
    assert pos[0, :10].tolist() == long.positions
    assert torch.equal(mask[0, 0, :10, :10], long.mask()) and not mask[0, 0, :10, 10:].any()
    assert torch.equal(mask[1, 0, :4, :4], short.mask()) and not mask[1, 0, :4, 4:].any()
    eye = torch.eye(n, dtype=torch.bool)
    assert torch.equal(mask[0, 0, 10:], eye[10:]) and torch.equal(mask[1, 0, 4:], eye[4:])


@pytest.mark.parametrize("scope", ["spans", "all"])
def test_dense_turns_run_on_the_base_weights_unless_the_adapter_is_merged(adapted, scope):
    """A dense prompt runs under the merged adapter as training's dense turns do; with the adapter apart, on the
    base weights (the student with its LoRA off)."""
    model, layers, _, engines = adapted
    engine = engines[scope]
    layout = segments_layout(engine.make_reqs(GenerateReqInput(text=PROMPT, **SETTINGS["isolated"]))[0].segments)
    dense = SpanLayout()
    dense.add(layout.dense_ids(), 0, None, True)
    with lora_off(layers) if scope == "spans" else contextlib.nullcontext():
        want_tokens, want_logps = student_greedy(model, dense, NEW)
    tokens, logps = served(engine, dense.ids, {})
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logps), torch.tensor(want_logps), atol=2e-4, rtol=1e-4)


def test_dense_and_span_prompts_share_no_kv_and_batch_together_with_the_adapter_apart(adapted):
    """The span prompt's plain prefix ("Answer the question.") was computed on the base weights by a dense prompt
    that starts with the same text: under the adapter it must be computed again, not read from the cache. Sent in
    one batch, each runs on its own weights."""
    model, layers, _, engines = adapted
    engine = engines["spans"]
    engine.flush_cache()
    given = SETTINGS["anchor+head"]
    dense_text = "Answer the question." + "".join(DOCS) + "Where is Paris?"
    layout = segments_layout(engine.make_reqs(GenerateReqInput(text=PROMPT, **given))[0].segments)
    dense = segments_layout(engine.make_reqs(GenerateReqInput(text=dense_text))[0].segments)
    want = {PROMPT: student_greedy(model, layout, NEW)}
    with lora_off(layers):
        want[dense_text] = student_greedy(model, dense, NEW)
    assert served(engine, dense_text, {})[0] == want[dense_text][0]
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    outs = engine.generate(prompt=[PROMPT, dense_text], sampling_params=params, return_logprob=True, **given)
    for text, out in zip([PROMPT, dense_text], outs):
        assert out["output_ids"] == want[text][0]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want[text][1]), atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_serve_the_adapter_apart_per_row(adapted, tiny_qwen2):
    """On CUDA (Triton, decode graphs captured with and without the row switch), in one batch: the span prompt
    answers as the merged adapter does, the dense prompt as the base model does; alone, the dense prompt too."""
    _, _, folder, _ = adapted
    dense_text = "Answer the question." + "".join(DOCS) + "Where is Paris?"
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}

    def logps(out):
        return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])

    outs, dense_alone, adapter_replays = {}, {}, {}
    for name, kwargs in {"spans": {"span_adapter": str(folder)}, "all": {"span_adapter": str(folder),
                         "span_adapter_scope": "all"}, "base": {}}.items():
        with Engine(model_path=str(tiny_qwen2), dtype="float32", device="cuda", attention_backend="triton",
                    max_total_tokens=4096, **kwargs) as engine:
            graphs = engine.runner.graph_runner
            dense_alone[name] = engine.generate(prompt=dense_text, sampling_params=params, return_logprob=True)
            adapter_replays[name] = graphs.num_adapter_replays
            outs[name] = [engine.generate(prompt=[PROMPT, dense_text], sampling_params=params, return_logprob=True,
                                          **SETTINGS["anchor+head"]) for _ in range(2)]  # cold, then cached
            adapter_replays[name] = (adapter_replays[name], graphs.num_adapter_replays)
    # A batch of dense requests replays the graphs captured without the adapter's rows; one with a span request,
    # those with them (the merged adapter has no rows to switch).
    assert adapter_replays["spans"][0] == 0 < adapter_replays["spans"][1]
    assert adapter_replays["all"] == adapter_replays["base"] == (0, 0)
    assert dense_alone["spans"]["output_ids"] == dense_alone["base"]["output_ids"]
    torch.testing.assert_close(logps(dense_alone["spans"]), logps(dense_alone["base"]), atol=2e-3, rtol=0)
    for spans, merged, base in zip(outs["spans"], outs["all"], outs["base"]):
        assert spans[0]["output_ids"] == merged[0]["output_ids"] != base[0]["output_ids"]
        torch.testing.assert_close(logps(spans[0]), logps(merged[0]), atol=2e-3, rtol=0)
        assert spans[1]["output_ids"] == base[1]["output_ids"]
        torch.testing.assert_close(logps(spans[1]), logps(base[1]), atol=2e-3, rtol=0)


def test_a_graph_replay_takes_the_adapter_graph_only_for_a_batch_with_its_rows():
    """Where an adapter is served apart, each size has a graph with the rows' switch and a plain one: a decode batch
    replays the first when a row runs under the adapter, else the plain one (the GPU test above runs both)."""
    from types import SimpleNamespace

    from sglang_pic.forward_batch import ForwardMode
    from sglang_pic.layers.triton_backend import TritonAttnBackend
    from sglang_pic.model_executor.cuda_graph_runner import CudaGraphRunner

    runner = object.__new__(CudaGraphRunner)
    runner.batch_sizes, runner.extend_sizes, runner.shared_plan = [4], [], None
    runner.adapter_variants, runner.num_adapter_replays = (False, True), 0
    runner.decode_inputs = SimpleNamespace(load=lambda *args: None)
    runner.req_to_token_pool = SimpleNamespace(padding_row=0)
    runner.attn_backend = TritonAttnBackend()  # nothing to plan before a replay
    replayed = []
    runner.graphs = {(ForwardMode.DECODE, 4, False, a): SimpleNamespace(replay=lambda a=a: replayed.append(a))
                     for a in (False, True)}
    runner.outputs = {key: torch.zeros(4, 2) for key in runner.graphs}
    runner.num_replays = {ForwardMode.DECODE: 0, ForwardMode.EXTEND: 0}
    for rows in ([0, 0, 0], [0, 1, 0], [0, 0]):
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(rows), shared_decode=None,
                                input_ids=torch.zeros(len(rows)), probe=None, span_scaling=None, deviation=None,
                                span_adapter_rows_cpu=rows)
        assert runner.replay(batch).shape == (len(rows), 2)
    assert replayed == [False, True, False] and runner.num_adapter_replays == 1
    runner.adapter_variants = (False,)  # no adapter apart: one graph per size, whatever the rows say
    batch.span_adapter_rows_cpu = [1, 1]
    assert runner._padded_key(batch)[3] is False


def test_the_adapter_changes_answers_and_lora_off_is_the_base_model(adapted, tiny_qwen2):
    """Guards the two tests above against an adapter that merged to nothing: the base engine answers otherwise."""
    model, layers, _, _ = adapted
    base = Engine(model_path=str(tiny_qwen2), dtype="float32", max_total_tokens=4096)
    try:
        layout = segments_layout(base.make_reqs(GenerateReqInput(text=PROMPT, **SETTINGS["anchor"]))[0].segments)
        with lora_off(layers):
            want = student_greedy(model, layout, NEW)
        got = served(base, PROMPT, SETTINGS["anchor"])
    finally:
        base.shutdown()
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), atol=2e-4, rtol=1e-4)
    assert student_greedy(model, layout, NEW)[1] != pytest.approx(want[1], abs=1e-3)


def test_adapter_files_round_trip_and_merge_checks_shapes(adapted, tmp_path):
    _, layers, folder, _ = adapted
    adapter = load_adapter(folder)
    assert set(adapter.factors) == set(layers) and adapter.rank == 4 and adapter.scale == 2.0
    name = next(iter(adapter.factors))
    a, b = adapter.factors[name]
    torch.testing.assert_close(a, layers[name].lora_A.detach())
    weight = torch.zeros(b.shape[0], a.shape[1])
    (merged_name, merged), = list(merged_weights(iter([(f"{name}.weight", weight)]),
                                                 SpanAdapter(4, 8.0, {name: (a, b)})))
    torch.testing.assert_close(merged, 2.0 * b @ a)
    with pytest.raises(ValueError, match="trained for another model"):
        list(merged_weights(iter([(f"{name}.weight", weight.t())]), SpanAdapter(4, 8.0, {name: (a, b)})))
    with pytest.raises(ValueError, match="lacks"):
        list(merged_weights(iter([]), SpanAdapter(4, 8.0, {name: (a, b)})))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        ServerArgs.from_kwargs(model_path="m", span_adapter=str(tmp_path))
    with pytest.raises(ValueError, match="span_adapter_scope must be spans or all"):
        ServerArgs.from_kwargs(model_path="m", span_adapter=str(folder), span_adapter_scope="dense")
    with pytest.raises(ValueError, match="pass --span-adapter-scope all"):  # LoRA apart needs dense activations
        ServerArgs.from_kwargs(model_path="m", span_adapter=str(folder), quantization="fp8")
    assert ServerArgs.from_kwargs(model_path="m", span_adapter=str(folder), quantization="fp8",
                                  span_adapter_scope="all").span_adapter_scope == "all"


def test_an_adapter_serves_apart_beside_dummy_weights_but_merges_into_checkpoints_only(tiny_qwen2, tmp_path):
    """benchmark/make_adapter.py's random factors beside dummy weights (how its cost is measured on big shapes):
    span prompts' logprobs move, dense ones' stay; merging into dummy weights is refused."""
    save_adapter(tmp_path, random_adapter(tiny_qwen2, rank=4), str(tiny_qwen2))
    outs = {}
    for name, kwargs in {"apart": {"span_adapter": str(tmp_path)}, "none": {}}.items():
        with Engine(model_path=str(tiny_qwen2), load_format="dummy", dtype="float32", max_total_tokens=2048,
                    **kwargs) as engine:
            outs[name] = [served(engine, p, SETTINGS["anchor"])[1] for p in (PROMPT, "Where is Paris? The capital")]
    assert outs["apart"][0] != pytest.approx(outs["none"][0], abs=1e-3) and outs["apart"][1] == outs["none"][1]
    with pytest.raises(ValueError, match="not dummy ones"):
        Engine(model_path=str(tiny_qwen2), load_format="dummy", dtype="float32", max_total_tokens=2048,
               span_adapter=str(tmp_path), span_adapter_scope="all")


def test_recorded_span_settings_are_defaults_that_flags_override(adapted):
    _, _, folder, _ = adapted
    args = ServerArgs.from_kwargs(model_path="m", span_adapter=str(folder))
    assert (args.span_anchor, args.span_head_tokens) == ("auto", 3)
    args = ServerArgs.from_kwargs(model_path="m", span_adapter=str(folder), span_anchor="none", span_head_tokens=0)
    assert (args.span_anchor, args.span_head_tokens) == ("none", 0)
    assert ServerArgs.from_kwargs(model_path="m").span_anchor == "auto"
    assert args.span_tail_tokens == 0 and ServerArgs.from_kwargs(model_path="m").span_tail_tokens == 0


def test_a_recorded_tail_and_selection_are_the_defaults(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "span_adapter.json").write_text(json.dumps({"span_settings": {
        "span_anchor": "auto", "span_head_tokens": 0, "span_tail_tokens": 8, "span_query_share": 0.1,
        "span_select": "lexical"}}))
    args = ServerArgs.from_kwargs(model_path="m", span_adapter=str(tmp_path))
    assert (args.span_tail_tokens, args.span_query_share, args.span_select) == (8, 0.1, "lexical")
    args = ServerArgs.from_kwargs(model_path="m", span_adapter=str(tmp_path), span_tail_tokens=2, span_query_share=0,
                                  span_select="query")
    assert (args.span_tail_tokens, args.span_query_share, args.span_select) == (2, 0, "query")
    plain = ServerArgs.from_kwargs(model_path="m")
    assert (plain.span_query_share, plain.span_select) == (0.0, "query")


def test_auto_names_the_shipped_adapter_with_its_settings(tmp_path, monkeypatch):
    """--span-adapter auto: the adapter shipped for the embedded model, verified, served at its recorded setting."""
    from sglang_pic import shipped_adapter

    args = ServerArgs.from_kwargs(model_path="m", span_adapter="auto")
    assert Path(args.span_adapter) == shipped_adapter.FOLDER.resolve()
    settings = (args.span_anchor, args.span_head_tokens, args.span_query_share, args.span_select)
    assert settings == ("auto", 0, 0.1, "lexical")
    adapter = load_adapter(args.span_adapter)
    assert adapter.rank == 16 and len(adapter.factors) == 24 * 7  # every decoder linear of Qwen2.5-0.5B's 24 layers
    damaged = tmp_path / "span_adapter"
    damaged.mkdir()
    for f in shipped_adapter.FOLDER.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes()[:-1] if f.suffix == ".safetensors" else f.read_bytes())
    monkeypatch.setattr(shipped_adapter, "FOLDER", damaged)
    with pytest.raises(ValueError, match="sha256"):
        ServerArgs.from_kwargs(model_path="m", span_adapter="auto")


@pytest.mark.slow
@pytest.mark.skipif(not default_model_installed(), reason="default-model packages not installed")
def test_the_embedded_model_with_auto_answers_from_the_asked_record():
    """The shipped adapter merged into the embedded model, at its setting: the record the question names is
    recomputed, the others reused, and the answer is that record's (anchored spans without it answer MIT here)."""
    records = ["Package: rivulet\nVersion: 3.2.1\nLicense: MIT\nAuthor: Dana Okafor",
               "Package: brambleweb\nVersion: 0.9.4\nLicense: Apache-2.0\nAuthor: Lars Lindqvist",
               "Package: quillstone\nVersion: 7.0.0\nLicense: BSD-3-Clause\nAuthor: Mei Tanaka"]
    prompt = ("<|im_start|>user\nHere are records." + "".join(span(r + "\n") for r in records)
              + "Which license does brambleweb use? Answer with the license name only.<|im_end|>\n"
              "<|im_start|>assistant\n")
    engine = Engine(span_adapter="auto", dtype="float32", max_total_tokens=8192)
    try:
        out = engine.generate(prompt=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
    finally:
        engine.shutdown()
    assert out["text"].strip() == "Apache-2.0"


def test_train_command_runs_and_resumes_on_a_tiny_model(tiny_qwen2, tmp_path):
    out = tmp_path / "adapter"
    args = ["--model-path", str(tiny_qwen2), "--out", str(out), "--batch-size", "2", "--docs", "2,3",
            "--passage-tokens", "16,48", "--answer-tokens", "4", "--device", "cpu", "--checkpoint-every", "1",
            "--seed", "3", "--teacher-batch", "4"]
    train_main([*args, "--steps", "2"])  # in this process: the resumed run below is the command's own start-up
    record = json.loads((out / "span_adapter.json").read_text())
    assert record["training"]["steps_done"] == 2 and record["training"]["seed"] == 3
    assert record["training"]["skipped_updates"] == 0 and record["training"]["teacher_batch"] == 4
    assert record["training"]["seconds_per_step"] > 0
    assert record["training"]["corpus"]["paragraphs"] > 100 and len(record["training"]["corpus"]["sha256"]) == 64
    assert record["span_settings"] == {"span_anchor": "auto", "span_head_tokens": 0}
    second = subprocess.run([sys.executable, "-m", "sglang_pic.train_span_adapter", *args, "--steps", "3"],
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 2" in second.stderr
    assert json.loads((out / "span_adapter.json").read_text())["training"]["steps_done"] == 3
    assert load_adapter(out).rank == 16


def test_two_processes_train_the_adapter_one_process_trains(tiny_qwen2, tmp_path):
    """torchrun with 2 processes (gloo on CPU): each takes half of every step's prompts and the gradients are
    summed, so the adapter is the one a single process writes with the same seed, up to the order of the sums."""
    args = ["--model-path", str(tiny_qwen2), "--batch-size", "4", "--micro-batch", "2", "--docs", "2,3",
            "--passage-tokens", "16,48", "--answer-tokens", "4", "--device", "cpu", "--seed", "3",
            "--teacher-batch", "8", "--steps", "2", "--rank", "4", "--alpha", "8"]
    train_main([*args, "--out", str(tmp_path / "one")])
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "sglang_pic.train_span_adapter", *args, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    single, pair = load_adapter(tmp_path / "one"), load_adapter(tmp_path / "two")
    assert pair.record["training"]["processes"] == 2 and single.record["training"]["processes"] == 1
    assert pair.record["training"]["final_loss"] == pytest.approx(single.record["training"]["final_loss"], rel=1e-5)
    for name, (a, b) in single.factors.items():
        assert torch.equal(pair.factors[name][0], a)  # the leader's A, drawn from the seed, reaches every process
        torch.testing.assert_close(pair.factors[name][1].float(), b.float(), atol=3e-7, rtol=1e-2)
        assert bool(b.abs().sum() > 0)


def _one_step_config(model: Path, out: Path, **fields):
    """A TrainConfig for one small CPU step on the tiny model (rank 4, 2 spans of 16-32 tokens, 2 answer tokens),
    with `fields` on top."""
    from sglang_pic.span_adapter.examples import ExampleSizes
    from sglang_pic.span_adapter.trainer import TrainConfig

    return TrainConfig(**{"model_path": str(model), "out": str(out), "steps": 1, "batch_size": 1, "rank": 4,
                          "alpha": 8.0, "answer_tokens": 2, "sizes": ExampleSizes(2, 2, 16, 32), "device": "cpu",
                          **fields})


def _continued_at_lr_0(folder, model: Path, out: Path, rank: int, alpha: float) -> tuple[SpanAdapter, SpanAdapter]:
    """One training step at lr 0 from the adapter in `folder`: (that adapter, the one the run wrote)."""
    from sglang_pic.span_adapter.trainer import Trainer

    Trainer(_one_step_config(model, out, lr=0.0, rank=rank, alpha=alpha, init_adapter=str(folder))).train()
    return load_adapter(folder), load_adapter(out)


def test_training_starts_from_a_saved_adapter(adapted, tiny_qwen2, tmp_path):
    """--init-adapter: the run's LoRA factors start as the saved ones (at lr 0 the adapter it writes is the same), and
    the record names where it started."""
    from sglang_pic.span_adapter.trainer import TrainConfig, Trainer

    _, _, folder, _ = adapted
    before, after = _continued_at_lr_0(folder, tiny_qwen2, tmp_path / "next", rank=4, alpha=8.0)
    for name, (a, b) in before.factors.items():
        assert torch.equal(after.factors[name][0], a.to(torch.bfloat16)) and bool(b.abs().sum() > 0)
        assert torch.equal(after.factors[name][1], b.to(torch.bfloat16))
    assert after.record["training"]["init_adapter"]["folder"] == str(folder)
    for rank, alpha in ((8, 8.0), (2, 4.0)):  # another scale; a lower rank
        with pytest.raises(ValueError, match="rank 4"):
            Trainer(TrainConfig(model_path=str(tiny_qwen2), out=str(tmp_path / "other"), rank=rank, alpha=alpha,
                                device="cpu", init_adapter=str(folder)))


def test_a_saved_adapter_goes_on_at_a_higher_rank(adapted, tiny_qwen2, tmp_path):
    """Rank 4 -> 8 at the same alpha / rank: at lr 0 every layer's update B A is the saved one."""
    _, _, folder, _ = adapted
    before, after = _continued_at_lr_0(folder, tiny_qwen2, tmp_path / "wider", rank=8, alpha=16.0)
    assert after.rank == 8
    for name, (a, b) in before.factors.items():
        wide_a, wide_b = after.factors[name]
        torch.testing.assert_close(wide_b.float() @ wide_a.float(), b.float() @ a.float(), atol=1e-2, rtol=1e-2)
        assert not wide_b[:, 4:].any() and bool(wide_a[4:].abs().sum() > 0)


def test_a_non_finite_gradient_skips_the_update_and_names_its_layer(tiny_qwen2, tmp_path):
    """A NaN in one layer's gradient: the step leaves every factor as it was, and the record says how many layers got
    one and which is deepest (where it appeared)."""
    from sglang_pic.span_adapter.trainer import Trainer

    trainer = Trainer(_one_step_config(tiny_qwen2, tmp_path / "nan"))
    name = list(trainer.layers)[3]
    trainer.layers[name].lora_A.register_hook(lambda grad: grad * float("nan"))
    before = {n: (layer.lora_A.detach().clone(), layer.lora_B.detach().clone()) for n, layer in trainer.layers.items()}
    entry = trainer.train_step()
    assert not entry["applied"] and entry["nonfinite"] == {"count": 1, "deepest": name}
    for n, layer in trainer.layers.items():
        assert torch.equal(layer.lora_A, before[n][0]) and torch.equal(layer.lora_B, before[n][1]), n
    trainer.save()
    training = load_adapter(trainer.config.out).record["training"]
    assert training["skipped_updates"] == 1 and training["skipped"][0]["nonfinite"]["deepest"] == name


def test_span_state_error_adds_to_the_loss_and_trains_the_adapter(tiny_qwen2, tmp_path):
    """--span-state-weight: the same step (same seed, so the same examples) with the span tokens' per-layer state
    error has a larger loss, by that error, which is zero for a student equal to the teacher (a fresh adapter
    under full attention) and positive under span attention; its gradient reaches the adapter."""
    from sglang_pic.span_adapter.trainer import Trainer, decoder_states, state_error_sum

    def trainer(weight: float, dense_share: float) -> Trainer:
        return Trainer(_one_step_config(tiny_qwen2, tmp_path / f"w{weight}_{dense_share}", batch_size=2, seed=5,
                                        dense_share=dense_share, span_state_weight=weight))

    plain, with_states = trainer(0.0, 0.0).train_step(), trainer(1.0, 0.0).train_step()
    assert with_states["applied"] and with_states["loss"] > plain["loss"] + 1e-4
    dense_plain, dense_states = trainer(0.0, 1.0).train_step(), trainer(1.0, 1.0).train_step()
    assert dense_states["loss"] == pytest.approx(dense_plain["loss"], abs=1e-7)  # B = 0: the teacher's states
    t = trainer(1.0, 0.0)
    example = t._examples(0)[0]
    _, layers = decoder_states(t.model, [example.layout], every_layer=True)
    assert len(layers) == t.model.config.num_hidden_layers
    grads = torch.autograd.grad(state_error_sum([layers[-2][0] * 1.5], [layers[-2][0]]), t.params,
                                allow_unused=True)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_hard_row_share_takes_the_kl_of_the_hardest_rows_only():
    """--hard-row-share: the loss sums the weighted KL of the highest-KL share of rows (rounded up), and only those
    rows get a gradient."""
    from sglang_pic.span_adapter.trainer import kl_sum

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    student = torch.randn(5, 8, requires_grad=True)
    teacher = student.detach() + torch.tensor([0.0, 2.0, 0.1, 1.0, 0.5])[:, None] * torch.randn(5, 8)
    weights = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0])
    each = torch.stack([kl_sum(student[i: i + 1], teacher[i: i + 1], weights[i: i + 1], head) for i in range(5)])
    each = each.detach()
    assert float(kl_sum(student, teacher, weights, head).detach()) == pytest.approx(float(each.sum()), rel=1e-5)
    hardest = each.topk(2).indices
    loss = kl_sum(student, teacher, weights, head, hard_share=0.4)
    assert float(loss.detach()) == pytest.approx(float(each[hardest].sum()), rel=1e-5)
    loss.backward()
    touched = {i for i in range(5) if bool(student.grad[i].abs().sum() > 0)}
    assert touched == set(hardest.tolist())


def test_examples_leave_room_for_the_answer_in_the_context(tiny_qwen2):
    """Prompts that would overflow the tiny model's 256-token context are drawn again; sizes that never fit say so."""
    from sglang_pic.span_adapter.corpus import build_corpus
    from sglang_pic.span_adapter.examples import ExampleMaker, ExampleSizes

    corpus = build_corpus()
    maker = ExampleMaker(str(tiny_qwen2), corpus, ExampleSizes(2, 3, 40, 90), answer_tokens=16)
    for seed in range(12):
        example = maker.example(random.Random(seed), {"span_anchor": "auto", "span_head_tokens": 0})
        assert len(example.layout.dense_ids()) + 16 <= 256
    never = ExampleMaker(str(tiny_qwen2), corpus, ExampleSizes(4, 4, 200, 200), answer_tokens=16)
    with pytest.raises(ValueError, match="overflow the model's context of 256 tokens"):
        never.example(random.Random(0), {})


def test_examples_under_the_lexical_setting_recompute_the_asked_records_span(tiny_qwen2):
    """`--settings` takes every span field a request does: a records turn drawn under the lexical setting is the
    anchored turn's prompt with the span that names the asked package recomputed in context (training then sees the
    attention the server gives that setting)."""
    from sglang_pic.span_adapter.corpus import build_corpus
    from sglang_pic.span_adapter.examples import ExampleMaker, ExampleSizes

    maker = ExampleMaker(str(tiny_qwen2), build_corpus(), ExampleSizes(2, 3, 16, 48), kinds={"records": 1.0},
                         answer_tokens=4)
    for seed in range(4):
        anchored = maker.example(random.Random(seed), SETTINGS["anchor"])
        lexical = maker.example(random.Random(seed), SETTINGS["anchor+lexical"])
        assert lexical.layout.dense_ids() == anchored.layout.dense_ids()
        in_span = [sum(s is not None and v for s, v in zip(e.layout.scope, e.layout.visible))
                   for e in (anchored, lexical)]
        assert 0 < in_span[1] < in_span[0], seed


def _label_offsets(text: str, lines: bool) -> dict[str, int]:
    """Where each field of a record text starts, found by its label line or its sentence."""
    from sglang_pic.span_adapter.examples import RECORD_SENTENCES

    marks = {label: (f"{label.capitalize()}: " if lines else sentence.split("{value}")[0])
             for label, sentence in RECORD_SENTENCES.items()}
    return {label: text.find(mark) for label, mark in marks.items() if mark in text}


def test_record_turns_ask_about_a_package_their_spans_hold(tiny_qwen2):
    """Records turns: installed packages' metadata as spans of one shape, and a question (sometimes the second of
    a conversation, after the first one's answer) about a package among them."""
    from sglang_pic.frontend_lang.markers import PDEP_MARKER, SSEP_MARKER
    from sglang_pic.span_adapter.corpus import build_corpus
    from sglang_pic.span_adapter.examples import (
        RECORD_QUESTIONS,
        ExampleMaker,
        ExampleSizes,
        _record_template,
        _record_text,
    )

    corpus = build_corpus()
    maker = ExampleMaker(str(tiny_qwen2), corpus, ExampleSizes(2, 4, 16, 64), kinds={"records": 1.0, "docs": 0})
    assert maker.kinds == {"records": 1.0}
    questions = {q.format(name=p.name): p.name for q in RECORD_QUESTIONS.values() for p in corpus.packages}
    questions_asked = []
    for seed in range(40):
        prompt = maker.prompt(random.Random(seed))
        records, _, after = prompt.rpartition(PDEP_MARKER)
        assert 2 <= prompt.count(SSEP_MARKER) <= 4
        asked = [name for q, name in questions.items() if q in after]
        assert asked and all(name in records for name in asked)
        questions_asked.append(len(asked))
    assert set(questions_asked) == {1, 2}  # single questions and conversations both occur
    template = _record_template(random.Random(0))
    orders = {tuple(sorted(_label_offsets(_record_text(p, random.Random(i), template), template[0]).items(),
                           key=lambda kv: kv[1])) for i, p in enumerate(corpus.packages[:20])}
    shared = [label for label in template[1] if all(label in dict(p.facts) for p in corpus.packages[:20])]
    assert len(shared) >= 3 and len({tuple(k for k, _ in o if k in shared) for o in orders}) == 1  # one field order
    shuffled = {tuple(k for k, _ in sorted(_label_offsets(_record_text(p, random.Random(i)), lines).items(),
                                           key=lambda kv: kv[1]) if k in shared)
                for i, p in enumerate(corpus.packages[:20]) for lines in (True, False)}
    assert len(shuffled) > 1  # without a template each record orders its fields its own way
    one_doc = ExampleMaker(str(tiny_qwen2), corpus, ExampleSizes(1, 1, 16, 64))  # --docs 1,1: no two records
    assert "records" not in one_doc.kinds
    for seed in range(8):
        one_doc.prompt(random.Random(seed))
    with pytest.raises(ValueError, match="no turn kind left"):
        ExampleMaker(str(tiny_qwen2), corpus, ExampleSizes(1, 1, 16, 64), kinds={"records": 1.0})


def test_train_command_refuses_bad_ranges(tiny_qwen2, tmp_path):
    run = subprocess.run([sys.executable, "-m", "sglang_pic.train_span_adapter", "--model-path", str(tiny_qwen2),
                          "--out", str(tmp_path), "--docs", "3,2"], capture_output=True, text=True)
    assert run.returncode == 2 and "MIN <= MAX" in run.stderr
    base = ["--model-path", "m", "--out", str(tmp_path)]
    for bad in ('{"recipes": 1}', '{"docs": -1}', '{"docs": 0}', '[1]'):
        with pytest.raises(SystemExit):
            parse_args([*base, "--turn-kinds", bad])
    config = parse_args([*base, "--turn-kinds", '{"records": 0.5, "docs": 0.5}'])
    assert config.turn_kinds == {"records": 0.5, "docs": 0.5}
    with pytest.raises(SystemExit):
        parse_args([*base, "--span-state-weight", "-1"])
    assert parse_args([*base, "--span-state-weight", "0.5"]).span_state_weight == 0.5
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            parse_args([*base, "--hard-row-share", bad])
    assert parse_args([*base, "--hard-row-share", "0.1"]).hard_row_share == 0.1
