"""--quantization fp8: linear weights in float8_e4m3fn per output channel, activations per token (issue 56).

The math (scales of exactly amax / 448, the CPU path that mirrors torch._scaled_mm, the error against a float
linear), the load (only the decoder's linears quantized, scales of the packed parts), fp8 checkpoints loaded as
stored (compressed-tensors and fbgemm_fp8, per-channel and per-tensor scales), and the engine's greedy tokens
against HF transformers whose linear layers run this file's own fp8 math: at tp 1, at tp 2 (each rank scales its
slice of a row-parallel layer's input), after weight updates, with chunked prefill, spans and an fp8 KV cache. Up
to GEMV_MAX_M bf16/fp16 rows (decode) the activations stay unquantized (W8A16). The GPU tests check the CUDA paths
(_scaled_mm, the W8A16 kernel) against the CPU ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from sglang_pic import Engine
from sglang_pic.frontend_lang.markers import span
from sglang_pic.kernels import fp8_gemv, norm_act
from sglang_pic.layers.quant_fp8 import GEMV_MAX_M, Fp8Rows, fp8_linear, fp8_linear_reference, quantize_rows
from sglang_pic.model_config import ModelConfig
from sglang_pic.model_loader.loader import load_model
from sglang_pic.server_args import ServerArgs

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
PROMPTS = [[5, 17, 42, 99, 7, 300, 12, 64, 200, 33, 8], [250, 3, 77], [9, 140, 141, 142, 143, 10, 11, 12]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SPAN_PROMPTS = [
    "Read this." + span("The capital of France is Paris, the capital of Japan is Tokyo.") + "Where is Paris?",
    span("A serving engine batches requests.") + "Which one?",
]
ENGINE = dict(dtype="float32", max_total_tokens=2048)


# ---- this file's own fp8 math, written apart from layers/quant_fp8.py -------------------------------------------


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: fp8 values and float32 scales amax / 448."""
    scale = t.float().abs().amax(dim=-1, keepdim=True) / 448.0
    return (t.float() / scale).to(FP8), scale.squeeze(-1)


class Fp8Reference(nn.Module):
    """A linear over fp8 weights as the engine serves it: tokens quantized per row of each of `shards` column slices
    (a row-parallel layer's ranks), fp8 products summed in float32, both scales applied, each slice's result rounded
    to bf16 and the slices summed in the input's dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, shards: int) -> None:
        super().__init__()
        self.weight, self.scale, self.bias, self.shards = weight, scale, bias, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.zeros(rows.shape[0], self.weight.shape[0], dtype=x.dtype)
        for cols in torch.arange(x.shape[-1]).chunk(self.shards):
            xq, x_scale = quantize(rows[:, cols])
            acc = xq.float() @ self.weight[:, cols].float().t()
            out += (acc * x_scale[:, None] * self.scale[None, :]).to(torch.bfloat16).to(x.dtype)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], -1)


def hf_reference(path: Path, stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None, tp: int = 1):
    """HF transformers' model of `path` with every decoder linear replaced by an Fp8Reference over its weight
    quantized here, or over `stored` (HF weight name -> fp8 weight and per-row scales)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    for name, module in list(hf.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in LINEARS:
                weight, scale = stored[f"{name}.{child_name}.weight"] if stored else quantize(child.weight.detach())
                shards = tp if child_name in ROW_PARALLEL else 1
                setattr(module, child_name, Fp8Reference(weight, scale, child.bias, shards))
    return hf


def greedy_reference(hf: nn.Module, prompts: list[list[int]], n: int = GREEDY["max_new_tokens"]) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs


def served(path: Path, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    with Engine(model_path=str(path), **ENGINE, **kwargs) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def decoded(engine: Engine, prompts=PROMPTS) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs, as decoding produced them."""
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [o["output_ids"] for o in outs], [[lp for lp, *_ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def forced_logprobs(engine: Engine, outputs: list[list[int]], prompts=PROMPTS) -> list[list[float]]:
    """Each output token's logprob given its prompt and the tokens before it, from one prefill over them all."""
    outs = engine.generate(input_ids=[p + o for p, o in zip(prompts, outputs)],
                           sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=[len(p) for p in prompts])
    return [[lp for lp, *_ in o["meta_info"]["input_token_logprobs"]] for o in outs]


# ---- fp8 checkpoints written by the test ----------------------------------------------------------------------


def write_fp8_checkpoint(src: Path, dst: Path, fmt: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`src` stored in fp8: fmt is ct-channel / ct-tensor (compressed-tensors, scales per channel / per tensor,
    the latter with static input scales) or fbgemm (fbgemm_fp8, per channel). Returns what it stored per weight:
    the fp8 tensor and its scale per row."""
    shutil.copytree(src, dst)
    stored, tensors = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.rpartition(".")[0].rpartition(".")[2] not in LINEARS:
            tensors[name] = t
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "ct-tensor":
            scale = t.abs().amax().reshape(1) / 448.0
            q = (t / scale).to(FP8)
            tensors[f"{prefix}.input_scale"] = torch.tensor([0.05])
            stored[name] = (q, scale.expand(t.shape[0]))
        else:
            q, rows = quantize(t)
            scale = rows[:, None]
            stored[name] = (q, rows)
        tensors[name], tensors[f"{prefix}.weight_scale"] = q, scale
        if fmt == "fbgemm":
            tensors[f"{prefix}.input_scale_ub"] = torch.tensor([1200.0])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(config))
    return stored


def quantization_config(fmt: str) -> dict:
    if fmt == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    strategy = fmt.removeprefix("ct-")
    inputs = {"type": "float", "num_bits": 8, "strategy": "token" if strategy == "channel" else "tensor",
              "dynamic": strategy == "channel", "symmetric": True}
    weights = {"type": "float", "num_bits": 8, "strategy": strategy, "dynamic": False, "symmetric": True}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
    }


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_llama, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("fp8")
    return {fmt: (root / fmt, write_fp8_checkpoint(tiny_llama, root / fmt, fmt))
            for fmt in ("ct-channel", "ct-tensor", "fbgemm")}


# ---- the math ---------------------------------------------------------------------------------------------------


def test_weight_scales_are_row_amax_over_448():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert torch.equal(scale, w.abs().amax(dim=1) / 448.0)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((48,), 448.0))  # each row's largest value hits 448
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4, subnormals (below 2^-6) an absolute 2^-10
    error = (q.float() * scale[:, None] - w).abs()
    assert (error <= 2**-4 * w.abs() + 2**-10 * scale[:, None]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_within_fp8_error_of_float(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 128, generator=gen).to(dtype)
    w, bias = torch.randn(96, 128, generator=gen) * 0.05, torch.randn(96, generator=gen).to(dtype)
    q, scale = quantize_rows(w)
    out = fp8_linear(x, q, scale, bias)
    assert out.shape == (2, 9, 96) and out.dtype == dtype
    for target in (fp8_linear_reference(x, q, scale, bias), (x.float() @ w.t() + bias.float()).to(dtype)):
        rel = (out.float() - target.float()).norm() / target.float().norm()
        assert 1e-4 < rel < 0.06, rel


def test_cpu_decode_rows_are_weight_only_math():
    """Up to GEMV_MAX_M bf16 rows: activations unquantized, fp32 sums of x times the dequantized weight, rounded
    once to bf16, as the GPU's W8A16 kernel does; one row more is the per-token quantized math."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(GEMV_MAX_M + 1, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen)
    q, scale = quantize_rows(w)
    expected = ((x[:GEMV_MAX_M].float() @ q.float().t()) * scale).bfloat16()
    assert torch.equal(fp8_linear(x[:GEMV_MAX_M], q, scale), expected)
    assert torch.equal(fp8_linear(x, q, scale), Fp8Reference(q, scale, None, shards=1)(x.float()).bfloat16())


def test_activations_quantized_by_their_producer_give_the_same_linear():
    """Fp8Rows (what the norm / SiLU kernels hand an fp8 linear on CUDA): the per-token fp8 values and scales of x
    give fp8_linear's result for x itself, bit for bit, leading dims, dtype and bias included."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, GEMV_MAX_M, 64, generator=gen).bfloat16()  # more rows than go unquantized
    q, scale = quantize_rows(torch.randn(32, 64, generator=gen))
    bias = torch.randn(32, generator=gen).bfloat16()
    values, scales = quantize_rows(x)
    got = fp8_linear(Fp8Rows(values, scales, x.dtype), q, scale, bias)
    assert got.shape == (3, GEMV_MAX_M, 32) and got.dtype == torch.bfloat16
    assert torch.equal(got, fp8_linear(x, q, scale, bias))


def test_cpu_path_is_the_scaled_mm_math():
    """Per-token fp8 activations, fp32 sums, both scales, then bf16: bit for bit what this file's reference does."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 64, generator=gen), torch.randn(32, 64, generator=gen)
    q, scale = quantize_rows(w)
    expected = Fp8Reference(q, scale, None, shards=1)(x)
    assert torch.equal(fp8_linear(x, q, scale), expected)
    assert torch.equal(fp8_linear(torch.zeros(3, 64), q, scale), torch.zeros(3, 32))  # a zero token stays zero


# ---- the load ---------------------------------------------------------------------------------------------------


def test_load_quantizes_only_the_decoder_linears(tiny_qwen2):
    """Qwen2 (q/k/v biases, tied embeddings): fp8 weights whose scales are amax / 448 of each packed row of the
    checkpoint; embeddings, norms and biases stay the checkpoint's float32."""
    config = ModelConfig.from_path(str(tiny_qwen2), device="cpu", quantization="fp8")
    model = load_model(config)
    ckpt = load_file(Path(tiny_qwen2) / "model.safetensors")
    attn = model.model.layers[1].self_attn
    dense = torch.cat([ckpt[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert attn.qkv_proj.weight.dtype == FP8 and attn.qkv_proj.weight.shape == dense.shape
    assert torch.equal(attn.qkv_proj.weight_scale, dense.abs().amax(dim=1) / 448.0)
    assert torch.equal(attn.qkv_proj.bias, torch.cat([ckpt[f"model.layers.1.self_attn.{p}.bias"]
                                                      for p in ("q_proj", "k_proj", "v_proj")]))
    mlp = model.model.layers[0].mlp
    for layer, rows in ((mlp.gate_up_proj, 2 * config.intermediate_size), (mlp.down_proj, config.hidden_size),
                        (attn.o_proj, config.hidden_size)):
        assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (rows,)
    assert model.lm_head is None and model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, ckpt["model.embed_tokens.weight"])
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"])
    fp8 = {n for n, p in model.named_parameters() if p.dtype == FP8}
    assert len(fp8) == 4 * config.num_hidden_layers


def test_dummy_weights_are_quantized_too(tiny_llama):
    config = ModelConfig.from_path(str(tiny_llama), device="cpu", quantization="fp8")
    a, b = (load_model(config, "dummy", seed=3).state_dict() for _ in range(2))
    assert all(torch.equal(a[k].float(), b[k].float()) for k in a)
    assert a["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert (a["model.layers.0.mlp.down_proj.weight_scale"] > 0).all()
    assert a["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor", "fbgemm"])
def test_fp8_checkpoint_loads_as_stored(fp8_checkpoints, fmt):
    """The stored bytes and scales, not recomputed ones: per-tensor scales of q, k and v differ and each part's rows
    keep their own."""
    path, stored = fp8_checkpoints[fmt]
    config = ModelConfig.from_path(str(path), device="cpu")
    assert config.quantization == "fp8"
    model = load_model(config)
    qkv = model.model.layers[1].self_attn.qkv_proj
    names = [f"model.layers.1.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([stored[n][0] for n in names]).view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat([stored[n][1] for n in names]))
    if fmt == "ct-tensor":
        assert len(set(qkv.weight_scale.tolist())) == 3


def test_fp8_checkpoint_serves_its_stored_weights(fp8_checkpoints, tiny_llama):
    """Per-tensor scales, static input scales ignored, chunked prefill: the tokens of HF running the stored weights."""
    path, stored = fp8_checkpoints["ct-tensor"]
    expected = greedy_reference(hf_reference(tiny_llama, stored), PROMPTS)
    assert served(path, chunked_prefill_size=4) == expected


# ---- the engine -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_serves_the_fp8_reference_tokens(arch, request):
    """Also: a token's logprob is the same decoded alone or prefilled beside others (per-token scales)."""
    path = request.getfixturevalue(f"tiny_{arch}")
    expected = greedy_reference(hf_reference(path), PROMPTS)
    with Engine(model_path=str(path), quantization="fp8", **ENGINE) as engine:
        tokens, logprobs = decoded(engine)
        forced = forced_logprobs(engine, tokens)
    assert tokens == expected
    assert forced == [pytest.approx(lp, abs=1e-4) for lp in logprobs]
    assert greedy_reference(AutoModelForCausalLM.from_pretrained(path), PROMPTS) != expected  # fp8 shows


def test_tp2_scales_each_ranks_input_slice(tiny_llama):
    """At tp 2 every rank holds the whole rows' weight scales and quantizes its half of o_proj's and down_proj's
    input on its own: HF with those layers split the same way gives the tokens."""
    expected = greedy_reference(hf_reference(tiny_llama, tp=2), PROMPTS)
    assert served(tiny_llama, quantization="fp8", tp_size=2) == expected


def test_weight_updates_requantize(tiny_llama, fp8_checkpoints):
    """update_weights_from_disk into fp8 layers (an fp8 checkpoint served without the flag) quantizes a dense
    checkpoint again and loads an fp8 one as stored; an engine without fp8 layers refuses an fp8 checkpoint."""
    path, stored = fp8_checkpoints["ct-tensor"]
    want = {tiny_llama: greedy_reference(hf_reference(tiny_llama), PROMPTS),
            path: greedy_reference(hf_reference(tiny_llama, stored), PROMPTS)}
    assert want[tiny_llama] != want[path]
    with Engine(model_path=str(path), **ENGINE) as engine:
        for folder in (tiny_llama, path):
            ok, why = engine.update_weights_from_disk(str(folder))
            assert ok, why
            assert decoded(engine)[0] == want[folder]
    with Engine(model_path=str(tiny_llama), **ENGINE) as engine:
        ok, why = engine.update_weights_from_disk(str(path))
        assert not ok and "quantization 'fp8' != None" in why, why


def test_vericache_over_fp8_weights_is_lossless(tiny_llama):
    """Drafts over compressed KV, verified by the fp8 model: per-token scales make each token's output independent
    of the tokens beside it, so verifying 8 at once gives decoding's tokens."""
    prompts = [PROMPTS[0] * 8, PROMPTS[2] * 12]
    expected = greedy_reference(hf_reference(tiny_llama), prompts, n=16)
    with Engine(model_path=str(tiny_llama), quantization="fp8", speculative_algorithm="vericache",
                speculative_num_draft_tokens=8, vericache_budget=24, **ENGINE) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
        stats = engine.scheduler.spec_worker.stats
    assert [o["output_ids"] for o in outs] == expected
    assert 0 < stats.accepted_drafts < stats.draft_tokens


def test_spans_with_an_fp8_kv_cache(tiny_llama):
    """fp8 weights combine with an fp8 KV cache: cached spans are reused and answer as when first computed."""
    with Engine(model_path=str(tiny_llama), quantization="fp8", kv_cache_dtype="fp8_e4m3", **ENGINE) as engine:
        cold = [o["output_ids"] for o in engine.generate(SPAN_PROMPTS, GREEDY)]
        warm = engine.generate(SPAN_PROMPTS, GREEDY)
    assert [o["output_ids"] for o in warm] == cold
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in warm)


# ---- refusals ---------------------------------------------------------------------------------------------------


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        ServerArgs(quantization="int4")


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "awq", "bits": 4}, "quantized with 'awq' are not supported"),
        ({**quantization_config("ct-channel"), "format": "int-quantized"}, "format 'int-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
            "type": "float", "num_bits": 8, "strategy": "block"}}}}, "8-bit by block"),
        ({**quantization_config("ct-channel"), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ],
)
def test_unsupported_checkpoint_formats_are_refused(tiny_llama, tmp_path, quantization_config, message):
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_path(str(folder), device="cpu")


def test_span_adapter_on_an_fp8_checkpoint_is_refused(fp8_checkpoints, tmp_path):
    path, _ = fp8_checkpoints["ct-channel"]
    with pytest.raises(ValueError, match="span adapter merges into dense weights"):
        load_model(ModelConfig.from_path(str(path), device="cpu"), span_adapter=str(tmp_path))


# ---- GPU ----------------------------------------------------------------------------------------------------------

def needs_fp8_gemm() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9+")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_fp8_linear_matches_the_cpu_path(m, dtype, bias):
    """fp8_linear on CUDA (bf16 at 1 and 7 rows: the W8A16 kernel; else _scaled_mm with row-wise scales) against the
    CPU path on the same operands: equal up to summation order."""
    needs_fp8_gemm()
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=gen).to(dtype)
    w = torch.randn(384, 512, generator=gen) * 0.02
    b = torch.randn(384, generator=gen).to(dtype) if bias else None
    q, scale = quantize_rows(w)
    cpu = fp8_linear(x, q, scale, b)
    cuda = fp8_linear(x.cuda(), q.cuda(), scale.cuda(), None if b is None else b.cuda()).cpu()
    assert cuda.dtype == dtype
    rel = (cuda.float() - cpu.float()).norm() / cpu.float().norm()
    assert rel < 4e-3, rel  # a bf16 rounding that summation order tips now and then
    reference = fp8_linear_reference(x, q, scale, b).float()
    assert (cuda.float() - reference).norm() / reference.norm() < 0.06


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_cuda_engine_agrees_with_the_cpu_fp8_engine(tiny_llama, fp8_checkpoints, tp_size, monkeypatch):
    """Triton attention and CUDA graphs over _scaled_mm linears, quantized at load or stored: the CPU fp8 engine
    prefilling the GPU's greedy tokens gives them the logprobs GPU decoding gave. Not token for token: the GPU's
    float rounding (TF32 attention) tips an fp8 rounding of an activation now and then, which moves this tiny
    random model's logprobs by up to a few tenths, while a wrong GEMM moves them by units."""
    needs_fp8_gemm()
    if torch.cuda.device_count() < tp_size:
        pytest.skip(f"needs {tp_size} GPUs")
    calls = count_scaled_mm(monkeypatch)
    stored, _ = fp8_checkpoints["ct-tensor"]
    for path, quantization in ((tiny_llama, "fp8"), (stored, None)):
        common = dict(model_path=str(path), quantization=quantization, tp_size=tp_size, **ENGINE)
        with Engine(device="cuda", attention_backend="triton", **common) as gpu:
            assert gpu.runner.graph_runner is not None
            tokens, logprobs = decoded(gpu)
            gpu.generate(SPAN_PROMPTS, GREEDY)
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in gpu.generate(SPAN_PROMPTS, GREEDY))
        with Engine(device="cpu", **common) as cpu:
            forced = forced_logprobs(cpu, tokens)
        assert_close_logprobs(forced, logprobs)
    assert calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_in_bf16_decodes_what_it_prefills(tiny_qwen2, monkeypatch):
    """The usual serving dtype, q/k/v biases added to the bf16 output: decoding (3 rows a step, the W8A16 kernel in
    CUDA graphs) and prefilling the same tokens (activations quantized per token, by the norms and the activation
    before q|k|v, gate|up and down, then _scaled_mm) agree up to the activations' fp8 rounding."""
    needs_fp8_gemm()
    calls = count_scaled_mm(monkeypatch)
    gemv_calls = count_calls(monkeypatch, fp8_gemv, "fp8_weight_matmul")
    fused_calls = [count_calls(monkeypatch, norm_act, f) for f in ("rms_norm_fp8", "silu_and_mul_fp8")]
    with Engine(model_path=str(tiny_qwen2), quantization="fp8", device="cuda", attention_backend="triton",
                **{**ENGINE, "dtype": "bfloat16"}) as gpu:
        assert gpu.runner.graph_runner is not None
        tokens, logprobs = decoded(gpu)
        forced = forced_logprobs(gpu, tokens)
    assert_close_logprobs(forced, logprobs)
    assert calls and gemv_calls and all(fused_calls)


def count_calls(monkeypatch: pytest.MonkeyPatch, module, name: str) -> list[int]:
    """A list that grows by one at every call of module.name (looked up at call time by its callers)."""
    calls, inner = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def count_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every torch._scaled_mm call (graph captures included)."""
    return count_calls(monkeypatch, torch, "_scaled_mm")


def assert_close_logprobs(got: list[list[float]], want: list[list[float]]) -> None:
    error = torch.tensor(sum(got, [])) - torch.tensor(sum(want, []))
    assert error.abs().max() < 0.6 and error.abs().mean() < 0.15, error
