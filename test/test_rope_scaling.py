"""YaRN rope scaling against transformers, and --json-model-override-args from config to a served long prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sglang_pic import Engine
from sglang_pic.layers.rotary_embedding import RotaryEmbedding
from sglang_pic.model_config import ModelConfig

QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# Positions inside and well past Qwen2.5's native 32K window.
POSITIONS = [0, 1, 7, 1000, 20000, 32767, 32768, 50000, 99999, 131071]
YARN_VARIANTS = {
    "defaults": QWEN25_YARN,
    "rope_type-key": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "explicit": {**QWEN25_YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    "no-truncate": {**QWEN25_YARN, "truncate": False},
    "mscale": {**QWEN25_YARN, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5},
}


def _hf_yarn(head_dim: int, scaling: dict) -> tuple[torch.Tensor, float, object]:
    """transformers' own YaRN inverse frequencies and attention factor for a Qwen2 config carrying `scaling`."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen2Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rope_scaling=dict(scaling),
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    return inv_freq, attention_factor, config


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", list(YARN_VARIANTS))
def test_yarn_table_matches_transformers(head_dim: int, variant: str) -> None:
    scaling = YARN_VARIANTS[variant]
    inv_freq, attention_factor, _ = _hf_yarn(head_dim, scaling)
    rope = RotaryEmbedding(head_dim, 131072, base=1000000.0, rope_scaling=dict(scaling))
    assert rope.cos_sin_cache.shape == (131072, head_dim) and rope.cos_sin_cache.dtype == torch.float32
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)

    # transformers forms the angles in float32, a few 1e-3 off at position 1e5; take its frequencies and factor
    # and form them in float64 instead.
    positions = torch.tensor(POSITIONS, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq.double())
    want = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    got = rope.cos_sin_cache[positions.long()].double()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    plain = RotaryEmbedding(head_dim, 131072, base=1000000.0).cos_sin_cache[positions.long()].double()
    assert (got - plain).abs().max() > 0.1, "yarn must change the table, else the comparison is vacuous"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_yarn_table_matches_transformers_rotary_module(head_dim: int) -> None:
    """The HF module's float32 cos/sin at short positions (where float32 angles are exact enough): same layout,
    attention factor on both cos and sin."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    _, _, config = _hf_yarn(head_dim, QWEN25_YARN)
    positions = torch.arange(64)
    cos, sin = Qwen2RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    half = head_dim // 2
    table = RotaryEmbedding(head_dim, 64, base=1000000.0, rope_scaling=dict(QWEN25_YARN)).cos_sin_cache
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-5, rtol=0)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-5, rtol=0)


def _write_config(folder: Path, **fields: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 384,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        **fields,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_override_scales_qwen25_context(tmp_path: Path) -> None:
    folder = str(_write_config(tmp_path / "qwen"))
    override = json.dumps({"rope_scaling": QWEN25_YARN})
    assert ModelConfig.from_path(folder, device="cpu").context_len == 32768
    config = ModelConfig.from_path(folder, device="cpu", json_model_override_args=override)
    assert config.context_len == 131072 and config.max_position_embeddings == 32768
    assert config.rope_scaling == QWEN25_YARN and config.rope_theta == 1000000.0
    assert config.hf_config["rope_scaling"] == QWEN25_YARN
    long = ModelConfig.from_path(folder, 131072, device="cpu", json_model_override_args=override)
    assert long.context_len == 131072
    assert ModelConfig.from_path(folder, 65536, device="cpu", json_model_override_args=override).context_len == 65536
    with pytest.raises(ValueError, match="131072"):
        ModelConfig.from_path(folder, 131073, device="cpu", json_model_override_args=override)
    with pytest.raises(ValueError, match="exceeds"):
        ModelConfig.from_path(folder, 65536, device="cpu")


def test_override_replaces_top_level_keys(tmp_path: Path) -> None:
    folder = str(_write_config(tmp_path / "qwen", rope_scaling={"type": "linear", "factor": 2.0}))
    config = ModelConfig.from_path(folder, device="cpu", json_model_override_args='{"max_position_embeddings": 512}')
    assert config.max_position_embeddings == config.context_len == 512
    assert config.rope_scaling == {"type": "linear", "factor": 2.0}
    cleared = ModelConfig.from_path(folder, device="cpu", json_model_override_args='{"rope_scaling": null}')
    assert cleared.rope_scaling is None


@pytest.mark.parametrize("bad", ["{rope_scaling: 1}", '{"a": 1', "[1, 2]", '"yarn"', "4"])
def test_bad_override_raises(tmp_path: Path, bad: str) -> None:
    folder = str(_write_config(tmp_path / "qwen"))
    with pytest.raises(ValueError, match="--json-model-override-args"):
        ModelConfig.from_path(folder, device="cpu", json_model_override_args=bad)


def test_context_rules_per_rope_type(tmp_path: Path) -> None:
    def context(name: str, **fields: object) -> int:
        return ModelConfig.from_path(str(_write_config(tmp_path / name, **fields)), device="cpu").context_len

    # No original window: it is max_position_embeddings, as transformers assumes.
    assert context("no-window", rope_scaling={"type": "yarn", "factor": 2.0}) == 65536
    # max_position_embeddings already states the stretched context: not stretched twice.
    stretched = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context("stretched", max_position_embeddings=131072, rope_scaling=stretched) == 131072
    # No factor: max_position_embeddings over the original window (DeepSeek style).
    deepseek = {"type": "yarn", "original_max_position_embeddings": 4096}
    config = ModelConfig.from_path(
        str(_write_config(tmp_path / "deepseek", max_position_embeddings=163840, rope_scaling=deepseek)), device="cpu"
    )
    assert config.context_len == 163840 and config.rope_scaling["factor"] == 40.0
    # transformers 5 layout.
    params = {"rope_theta": 500000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = ModelConfig.from_path(str(_write_config(tmp_path / "v5", rope_parameters=params)), device="cpu")
    assert config.context_len == 131072 and config.rope_theta == 500000.0 and "rope_theta" not in config.rope_scaling
    # llama3 and linear keep max_position_embeddings.
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert context("llama3", max_position_embeddings=131072, rope_scaling=llama3) == 131072
    assert context("linear", rope_scaling={"type": "linear", "factor": 4.0}) == 32768


def _hf_greedy(path: Path, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their log-probabilities from transformers, one full forward per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids, out, logps = list(ids), [], []
    for _ in range(n):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        tok = int(logp.argmax())
        out.append(tok)
        logps.append(logp[tok])
        ids.append(tok)
    return out, torch.stack(logps)


def test_engine_serves_past_native_context_with_override(tiny_qwen2: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    native = cfg["max_position_embeddings"]
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": native}
    prompt = torch.randint(4, cfg["vocab_size"], (400,), generator=torch.Generator().manual_seed(0)).tolist()
    assert native < len(prompt) < 4 * native
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    # The reference: the same checkpoint with YaRN written into its config.json, run by transformers.
    yarn_folder = tmp_path / "qwen2_yarn"
    shutil.copytree(tiny_qwen2, yarn_folder)
    cfg["rope_parameters"] = {"rope_theta": cfg["rope_parameters"]["rope_theta"], "rope_type": "yarn", **scaling}
    (yarn_folder / "config.json").write_text(json.dumps(cfg))
    want_ids, want_logps = _hf_greedy(yarn_folder, prompt, 6)
    _, plain_logps = _hf_greedy(tiny_qwen2, prompt, 6)
    assert (want_logps - plain_logps).abs().max() > 1e-2, "yarn must change the outputs, else the test is vacuous"

    with Engine(model_path=str(tiny_qwen2), device="cpu", dtype="float32", max_total_tokens=4096) as engine:
        assert engine.model_config.context_len == native
        with pytest.raises(ValueError, match="context length"):
            engine.generate(input_ids=prompt, sampling_params=params)

    override = json.dumps({"rope_scaling": scaling})
    with Engine(
        model_path=str(tiny_qwen2),
        device="cpu",
        dtype="float32",
        max_total_tokens=4096,
        json_model_override_args=override,
    ) as engine:
        assert engine.model_config.context_len == 4 * native
        assert engine.runner.model.rotary.cos_sin_cache.shape[0] == 4 * native
        out = engine.generate(input_ids=prompt, sampling_params=params, return_logprob=True)
    assert out["output_ids"] == want_ids
    got_logps = torch.tensor([lp for lp, _, *_ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got_logps, want_logps, atol=2e-4, rtol=1e-4)
