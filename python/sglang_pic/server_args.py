"""All engine and server settings in one dataclass, named as in SGLang so its users feel at home."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_pic.kv_cache_dtype import KV_CACHE_DTYPES
from sglang_pic.parser_names import REASONING_PARSER_NAMES as REASONING_PARSERS
from sglang_pic.parser_names import TOOL_CALL_PARSER_NAMES as TOOL_CALL_PARSERS
from sglang_pic.quant_config import check_quantization
from sglang_pic.shipped_adapter import AUTO, shipped_adapter
from sglang_pic.span_policy import DEFAULT_HEAD_TOKENS, check_settings


def _arg(default: Any, help: str) -> Any:
    """A field whose help text `python -m sglang_pic.launch_server --help` shows. A None default means the value is
    chosen later (from the model, the device, another flag), so its help must say what happens: "default: ..."."""
    if default is None and "default:" not in help:
        raise ValueError(f"a field defaulting to None must say what happens instead ('default: ...'): {help!r}")
    return field(default=default, metadata={"help": help})


# The span settings a span adapter's record may set, with their values where it does not (span_head_tokens: None
# stays for resolved_span_head_tokens to choose).
UNRECORDED_SPAN_SETTINGS: dict[str, Any] = {"span_anchor": "auto", "span_head_tokens": None, "span_tail_tokens": 0,
                                            "span_query_share": 0.0, "span_select": "query"}


@dataclass
class ServerArgs:
    model_path: str | None = _arg(
        None,
        "The model to serve: a HF folder (config.json + safetensors) or a .gguf file; default: the embedded "
        "Qwen2.5-Coder-0.5B-Instruct.",
    )
    tokenizer_path: str | None = _arg(None, "The tokenizer folder, when it is not the model's; default: the model's.")
    load_format: str = _arg(
        "auto",
        "How weights are read: auto (safetensors, or a .gguf converted once), dummy (random) or gguf.",
    )
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype: auto (float32 on CPU, the checkpoint's dtype on GPU), float32, bfloat16 "
        "or float16.",
    )
    quantization: str | None = _arg(
        None,
        "fp8: every linear layer of the decoder (attention and MLP projections) holds float8_e4m3fn weights with "
        "one scale per output channel, quantized at load from a bf16/fp16/fp32 checkpoint, and quantizes its "
        "activations per token as it runs (torch._scaled_mm on GPUs of compute capability 8.9+, a matmul with the "
        "same rounding on CPU), except in steps of up to 16 bf16/fp16 rows (decode), which multiply unquantized "
        "activations with the fp8 weights; the LM head and embeddings keep the model's dtype. fp8 checkpoints "
        "(compressed-tensors float-quantized, fbgemm_fp8) load as stored, scales included. default: none, unless "
        "the checkpoint is fp8.",
    )
    device: str = _arg("auto", "auto, cpu or cuda.")
    context_length: int | None = _arg(
        None,
        "Override the model's context length; default: the model's (max_position_embeddings, times the factor of a "
        "YaRN rope_scaling).",
    )
    json_model_override_args: str = _arg(
        "",
        "A JSON object merged over the model's config.json (top-level keys replace); "
        '{"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}} serves '
        "Qwen2.5 at 128K.",
    )
    trust_remote_code: bool = _arg(
        False,
        "Accepted for SGLang compatibility; only the built-in model classes are used.",
    )
    served_model_name: str | None = _arg(
        None,
        "The model name reported by /v1/models and in OpenAI responses; default: the model path.",
    )
    chat_template: str | None = _arg(
        None,
        "Chat template for /v1/chat/completions: a built-in name (chatml, llama-3-instruct), a Jinja file, or "
        "a JSON file with a chat_template key; default: the tokenizer's.",
    )
    tool_call_parser: str | None = _arg(
        None,
        "How /v1/chat/completions finds tool calls in replies: qwen25 (<tool_call> JSON, Qwen2.5/Qwen3 and "
        "Hermes-style templates), llama3 (JSON objects) or mistral ([TOOL_CALLS] and a JSON list); default: the "
        "model family's.",
    )
    reasoning_parser: str | None = _arg(
        None,
        "Split a reasoning model's thinking (<think>...</think>) from its answer in /v1/chat/completions, into "
        "reasoning_content: deepseek-r1 or qwen3-thinking (the template opens the thinking), qwen3 (the reply "
        "may open it); default: none, the thinking stays in content.",
    )

    # Memory and caching.
    max_total_tokens: int | None = _arg(
        None,
        "KV cache size in tokens; default: from --mem-fraction-static on GPU, 65536 on CPU.",
    )
    mem_fraction_static: float = _arg(0.85, "Share of GPU memory for the weights and the KV cache.")
    page_size: int = _arg(1, "Tokens per KV cache page.")
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache storage: auto (the model's dtype), bf16 / bfloat16, fp8_e4m3 or fp8_e5m2. fp8 halves the bf16 "
        "bytes a cached token takes and decode reads; each layer's keys and values get a power-of-two scale fixed "
        "at start by one forward over fixed tokens, and widen to the model's dtype inside attention. Not with the "
        "flashinfer backend or VeriCache.",
    )
    max_running_requests: int = _arg(256, "Most requests running at once.")
    max_queued_requests: int | None = _arg(
        None,
        "Server: refuse new requests with 503 while this many wait beyond the max_running_requests (per data "
        "parallel replica) being served, so an overload is pushed back to clients instead of piling up; default: "
        "no limit.",
    )
    disable_radix_cache: bool = _arg(False, "Turn off prefix and span caching.")
    enable_hierarchical_cache: bool = _arg(
        False,
        "Move KV the prefix/span cache evicts from the device to host memory and bring it back on a hit.",
    )
    hicache_ratio: float = _arg(2.0, "Host cache size as a multiple of the device KV pool's tokens.")
    hicache_size: float = _arg(0.0, "Host cache size in GB; overrides --hicache-ratio when above 0.")

    # Scheduling.
    chunked_prefill_size: int = _arg(8192, "Most prompt tokens prefilled in one step; -1 turns chunking off.")
    max_prefill_tokens: int = _arg(16384, "Prefill tokens per step when chunking is off.")
    schedule_policy: str | None = _arg(
        None,
        "fcfs, lpm (longest cached prefix first) or isps; default: isps with PIC, fcfs with --disable-pic.",
    )
    step_token_budget: int | None = _arg(
        None,
        "Prefill tokens per ISPS step next to the decodes; default: the chunk size.",
    )
    isps_max_wait_steps: int = _arg(32, "ISPS serves any work that has waited this many steps first.")
    enable_priority_scheduling: bool = _arg(
        False,
        "Admit waiting requests by their `priority` first (larger first), then by the schedule policy; a request "
        "that cannot be admitted preempts running ones of lower priority (see the threshold).",
    )
    schedule_low_priority_values_first: bool = _arg(
        False, "With priority scheduling, smaller `priority` values are more urgent."
    )
    priority_scheduling_preemption_threshold: int = _arg(
        10,
        "A waiting request preempts a running one only when its priority exceeds the running one's by more than "
        "this; a large value turns preemption off.",
    )
    abort_on_priority_when_disabled: bool = _arg(
        False, "Refuse requests that set `priority` while priority scheduling is off (by default it is ignored)."
    )
    schedule_conservativeness: float = _arg(
        1.0,
        "Scales the decode tokens reserved when admitting requests; higher admits fewer.",
    )
    enable_mixed_chunk: bool = _arg(False, "Run the decodes in the same step as a prefill chunk.")
    enable_jump_forward: bool = _arg(
        False,
        "Constrained decoding: append the tokens a grammar forces next (xgrammar's tokenization of them) and "
        "prefill them in one step instead of decoding each; faster for JSON with fixed keys, though the forced "
        "text may be tokenized differently than the model would have sampled it.",
    )
    stream_interval: int = _arg(
        1,
        "Tokens per streamed chunk: a stream sends its first token at once, then a chunk every this many tokens, "
        "then the rest when the request ends; 1 sends every token, larger values cut the per-token cost of many "
        "streams.",
    )
    disable_overlap_schedule: bool = _arg(
        False,
        "Commit each step's tokens before launching the next (by default the next step runs on the GPU while "
        "the host commits and streams the last one's tokens).",
    )

    # Kernels.
    attention_backend: str | None = _arg(
        None, "torch_native, triton or flashinfer (GPU, FlashInfer installed); default: triton on GPU, torch_native "
        "on CPU."
    )
    disable_cuda_graph: bool = _arg(False, "Do not capture CUDA graphs.")
    skip_kernel_warmup: bool = _arg(
        False, "Do not compile every attention kernel variant at startup on a GPU (each then compiles on first use)."
    )
    cuda_graph_max_bs: int = _arg(
        256,
        "Largest decode batch captured in a CUDA graph (at most --max-running-requests). The default covers every "
        "decode batch the default --max-running-requests allows, so no decode step runs uncaptured.",
    )
    disable_shared_decode: bool = _arg(
        False,
        "Turn off shared decode. Shared decode (Triton backend) reads a cached run of KV (a span, a system prompt) "
        "once per decode step for all running requests that hold it, at whatever offset, rather than once per "
        "request (on a GPU, runs of 1024+ tokens; steps where that saves little read keys per request).",
    )
    cuda_graph_max_extend_tokens: int = _arg(
        256,
        "Largest one-request extend (new tokens, e.g. a prompt whose spans are cached) replayed from a CUDA graph; "
        "0 captures none.",
    )

    # Parallelism.
    tp_size: int = _arg(
        1,
        "Tensor parallelism: ranks (processes, one GPU each) that split every layer of one model replica.",
    )
    dp_size: int = _arg(
        1,
        "Data parallelism (server only): model replicas, each a scheduler process with its own KV cache.",
    )
    load_balance_method: str = _arg(
        "round_robin",
        "How the server picks a data-parallel replica per request: round_robin or shortest_queue (fewest "
        "unfinished requests).",
    )

    # Position-independent caching.
    disable_pic: bool = _arg(
        False,
        "Turn off position-independent caching: span markers are ignored and prompts are plain prefixes.",
    )
    ssep_marker: str = _arg("<|ssep|>", "Text marker that starts a reusable span.")
    pdep_marker: str = _arg("<|pdep|>", "Text marker that starts prompt-dependent text after spans.")
    span_settings_marker: str = _arg(
        "<|span_settings|>",
        "Text marker right after a span marker that opens the span's own settings, a JSON object with "
        "span_anchor, span_head_tokens, span_tail_tokens, span_query_share, span_select, "
        "span_attention_temperature, span_attention_scale and/or span_recompute (what span(doc, anchor=..., "
        "head_tokens=...) writes).",
    )
    span_adapter: str | None = _arg(
        None,
        "A span adapter folder (made by python -m sglang_pic.train_span_adapter, or any PEFT LoRA of the model), or "
        "auto: the one shipped for the embedded model (Qwen2.5-Coder-0.5B-Instruct; docs/server.md), served as "
        "--span-adapter-scope says; its recorded span settings become the defaults of --span-anchor, "
        "--span-head-tokens, --span-tail-tokens, --span-query-share and --span-select. default: none.",
    )
    span_adapter_scope: str = _arg(
        "spans",
        "Which requests run under the span adapter: spans (those whose prompt keeps a span after its settings "
        "apply: the adapter is added on their rows only, dense requests run on the base weights and keep their "
        "answers; their KV never shares a radix entry) or all (merged into the weights at load: no cost per token, "
        "but dense requests run under it too, which cost the shipped adapter 1.9 points).",
    )
    span_anchor: str | None = _arg(
        None,
        "Tokens every span is prefilled behind, so its first token is no attention sink: auto (the chat "
        "template's opening, else BOS), none (isolated spans, for block-attention fine-tuned models), prefix (the "
        "prompt's own text before its first marker) or the text itself. Needs the radix cache and --page-size 1; "
        "auto turns into none without them. default: the span adapter's recorded anchor, else auto.",
    )
    span_head_tokens: int | None = _arg(
        None,
        "Leading tokens of every span each request recomputes with full attention over the prompt before it "
        "(0: none); default: the span adapter's recorded head, else the recommended value where the radix cache "
        "and --page-size 1 allow it, else 0.",
    )
    span_tail_tokens: int | None = _arg(
        None,
        "Trailing tokens of every span each request recomputes likewise; with --span-head-tokens, each span's two "
        "seams. Needs the radix cache and --page-size 1. default: the span adapter's recorded tail, else 0.",
    )
    tool_spans: str = _arg(
        "off",
        "on: every chat request with tools gets each tool description as a span (with the server's span settings), so "
        "agents that resend their tools in another order or subset reuse them without any extra field; a request's "
        "own tool_spans overrides it. off: only requests asking for it.",
    )
    span_query_share: float | None = _arg(
        None,
        "Share of each request's span tokens it also recomputes, chosen per request as --span-select says (by "
        "default a probe pass: the text after the last span runs over the reused span KV, and the span tokens its "
        "queries attend to most are recomputed; 0: none). Needs the radix cache and --page-size 1. default: the "
        "span adapter's recorded share, else 0.",
    )
    span_select: str | None = _arg(
        None,
        "How each request chooses the --span-query-share of span tokens it recomputes: query (a probe pass scores "
        "them by the attention the text after the spans pays them), deviation (a pass through the first layers "
        "scores them by how far their KV with full attention is from the shared copy) or lexical (no pass: whole "
        "spans that share the question's rarest words, at least the best one). A request or a span may override it. "
        "default: the span adapter's recorded choice, else query.",
    )
    span_attention_temperature: float = _arg(
        1.0,
        "APE's attention temperature T for span keys: a query after the spans sees the keys of spans encoded apart "
        "from it with logits divided by T (1: plain attention). A request or a span may override it. Not with "
        "speculative decoding.",
    )
    span_attention_scale: float = _arg(
        1.0,
        "APE's scale S for span keys: their softmax group weighs exp(S * T * LSE) against the other keys, LSE the "
        "log-sum-exp of their tempered logits (1 with T = 1: plain attention). A request or a span may override it.",
    )
    ssep_token_id: int = _arg(-1, "Id that stands for the span marker in input_ids.")
    pdep_token_id: int = _arg(-2, "Id that stands for the prompt-dependent marker in input_ids.")

    # Lossless compressed-KV speculation (VeriCache).
    speculative_algorithm: str | None = _arg(None, "Speculative decoding algorithm: vericache; default: none.")
    speculative_num_draft_tokens: int | None = _arg(
        None,
        "Draft tokens per speculative step; default: 16 with VeriCache (on the real model 16 drafts gave more "
        "tokens per round than 8 for every compressor). With host full KV, drafting runs while the first "
        "--vericache-staging-gb of layers copy, so it hides behind the transfer when that budget holds enough.",
    )
    vericache_compressor: str = _arg(
        "streaming",
        "KV compressor VeriCache drafts with: streaming, snapkv, h2o or kivi.",
    )
    vericache_budget: float = _arg(
        0.25,
        "KV kept for drafting: below 1 a fraction of the context, else a number of tokens.",
    )
    vericache_full_kv: str = _arg("gpu", "Where VeriCache keeps the full KV: gpu or host.")
    vericache_staging_gb: float = _arg(
        4.0,
        "Device memory (GiB) for the layers of host-tier full KV staged during a verification; at least two "
        "layers are staged whatever it says. More layers stage while the group drafts.",
    )
    vericache_stagger_groups: int = _arg(
        1,
        "Requests per VeriCache round go in this many groups, drafted and verified in turn: with host full KV, "
        "one group's transfer runs while the next group drafts and the previous one verifies.",
    )

    # Server.
    host: str = _arg("127.0.0.1", "Address the HTTP server listens on.")
    port: int = _arg(30000, "Port the HTTP server listens on.")
    api_key: str | None = _arg(
        None, "Require `Authorization: Bearer <key>` on every route but /health; default: no key, every route open."
    )
    log_level: str = _arg(
        "info",
        "Logging level: debug, info, warning or error. At info the server logs one line per HTTP request: route, "
        "status, latency and a generation's rid and prompt, span, cached and completion tokens, or a refusal's error.",
    )
    log_requests: bool = _arg(
        False,
        "Server: also log each request's contents on its line, in the detail of --log-requests-level (off by "
        "default, as in SGLang: prompts and outputs stay out of the log).",
    )
    log_requests_level: int = _arg(
        2,
        "With --log-requests: 0 nothing more, 1 the sampling params, 2 also the prompt and output cut to 2048 "
        "characters each, 3 them whole (SGLang's levels).",
    )
    step_trace: str | None = _arg(
        None,
        "Append one JSON line per forward step to this file: its kind, requests and tokens, whether a CUDA graph "
        "replayed, host time, device time (CUDA events, read once the step has passed) and idle gaps "
        "(managers/step_trace.py; benchmark/bench_serving_breakdown.py attributes a run's time from it); with "
        "--dp-size N each replica writes PATH.dp<rank>; default: off.",
    )
    random_seed: int = _arg(0, "Seed for dummy weights and for torch's global random state.")
    skip_tokenizer_init: bool = _arg(
        False,
        "Do not load a tokenizer (offline Engine only: input_ids in, output_ids out).",
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            choices = ", ".join(TOOL_CALL_PARSERS)
            raise ValueError(f"tool_call_parser must be one of {choices}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            choices = ", ".join(REASONING_PARSERS)
            raise ValueError(f"reasoning_parser must be one of {choices}, got {self.reasoning_parser!r}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.load_format not in ("auto", "dummy", "gguf"):
            raise ValueError(f"load_format must be auto, dummy or gguf, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        check_quantization(self.quantization)
        if self.span_adapter_scope not in ("spans", "all"):
            raise ValueError(f"span_adapter_scope must be spans or all, got {self.span_adapter_scope!r}")
        if self.span_adapter_apart() and self.quantization is not None:
            raise ValueError("a span adapter kept apart from the weights needs dense ones; with --quantization, "
                             "pass --span-adapter-scope all")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.schedule_policy is None:
            self.schedule_policy = "fcfs" if self.disable_pic else "isps"
        if self.schedule_policy not in ("fcfs", "lpm", "isps"):
            raise ValueError(f"schedule_policy must be fcfs, lpm or isps, got {self.schedule_policy!r}")
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ValueError(f"log_requests_level must be 0, 1, 2 or 3, got {self.log_requests_level}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError(
                "priority_scheduling_preemption_threshold must be >= 0, got "
                f"{self.priority_scheduling_preemption_threshold}"
            )
        if self.chunked_prefill_size is not None and self.chunked_prefill_size <= 0:
            self.chunked_prefill_size = None
        if self.attention_backend not in (None, "torch_native", "triton", "flashinfer"):
            raise ValueError(
                f"attention_backend must be torch_native, triton or flashinfer, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype.startswith("fp8") and (
            self.attention_backend == "flashinfer" or self.speculative_algorithm is not None
        ):
            raise ValueError(
                "kv_cache_dtype fp8 runs on the triton and torch_native backends without speculative decoding: the "
                "flashinfer backend and VeriCache's drafts read the pool in the model's dtype"
            )
        if self.speculative_algorithm not in (None, "vericache"):
            raise ValueError(f"speculative_algorithm must be vericache, got {self.speculative_algorithm!r}")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size and dp_size must be >= 1, got {self.tp_size} and {self.dp_size}")
        if self.enable_hierarchical_cache and self.tp_size > 1:
            raise ValueError("the hierarchical cache copies rank 0's KV only; it does not support tp_size > 1")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError(
                f"hicache_ratio must be > 0 and hicache_size >= 0, got {self.hicache_ratio} and {self.hicache_size}"
            )
        if self.vericache_staging_gb <= 0:
            raise ValueError(f"vericache_staging_gb must be > 0, got {self.vericache_staging_gb}")
        if self.vericache_stagger_groups < 1:
            raise ValueError(f"vericache_stagger_groups must be >= 1, got {self.vericache_stagger_groups}")
        if self.tp_size > 1 and self.speculative_algorithm is not None:
            raise ValueError("speculative decoding does not support tp_size > 1")
        if self.load_balance_method not in ("round_robin", "shortest_queue"):
            raise ValueError(
                f"load_balance_method must be round_robin or shortest_queue, got {self.load_balance_method!r}"
            )
        self._take_adapter_settings()
        for name in ("span_head_tokens", "span_tail_tokens"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tool_spans not in ("on", "off"):
            raise ValueError(f"tool_spans must be on or off, got {self.tool_spans!r}")
        if not 0 <= self.span_query_share <= 1:
            raise ValueError(f"span_query_share must be in [0, 1], got {self.span_query_share}")
        check_settings({"span_select": self.span_select, "span_attention_temperature": self.span_attention_temperature,
                        "span_attention_scale": self.span_attention_scale})
        if (self.span_attention_temperature, self.span_attention_scale) != (1.0, 1.0):
            self.check_span_attention()
        explicit = self.span_anchor not in ("auto", "none") or bool(
            self.span_head_tokens or self.span_tail_tokens or self.span_query_share
        )
        if explicit and not self.disable_pic and not self.spans_from_jobs():  # without PIC there are no spans
            raise ValueError(
                "span_anchor, span_head_tokens, span_tail_tokens and span_query_share need the radix cache and "
                "page_size 1 (span KV then comes from span jobs only); use span_anchor auto or none and 0 recomputed "
                "tokens here"
            )
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path

    def _take_adapter_settings(self) -> None:
        """Check --span-adapter's folder and fill the span settings left unset from its record."""
        recorded: dict[str, Any] = {}
        if self.span_adapter is not None:
            folder = shipped_adapter() if self.span_adapter == AUTO else Path(self.span_adapter).expanduser()
            if not (folder / "adapter_config.json").is_file():
                raise ValueError(f"span_adapter {self.span_adapter!r} is no adapter folder (no adapter_config.json)")
            self.span_adapter = str(folder.resolve())
            record = folder / "span_adapter.json"
            recorded = json.loads(record.read_text()).get("span_settings", {}) if record.is_file() else {}
        for name, default in UNRECORDED_SPAN_SETTINGS.items():
            if getattr(self, name) is None:
                setattr(self, name, recorded.get(name, default))

    def span_adapter_apart(self) -> bool:
        """Whether a span adapter is served apart from the weights, to requests that keep a span only."""
        return self.span_adapter is not None and self.span_adapter_scope == "spans"

    def spans_from_jobs(self) -> bool:
        """Whether anchored spans and recomputed heads can be served (span_policy.py): their KV lives only in the
        radix tree, in one-token pages (a span's partial last page is never cached)."""
        return not (self.disable_radix_cache or self.disable_pic) and self.page_size == 1

    def check_span_attention(self) -> None:
        """Refuse APE's span attention scaling where it does not run: VeriCache's draft kernel does not scale."""
        if self.speculative_algorithm is not None:
            raise ValueError("span_attention_temperature and span_attention_scale do not run with speculative decoding")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch_native"

    def resolved_span_head_tokens(self) -> int:
        """The span head each request recomputes by default: the flag's, else the recommended one where spans
        come from span jobs, else none."""
        if self.span_head_tokens is not None:
            return self.span_head_tokens
        return DEFAULT_HEAD_TOKENS if self.spans_from_jobs() else 0

    def resolved(self) -> dict[str, Any]:
        """Every setting, with the ones chosen at start-up (device, attention backend, span head) filled in, as
        /get_server_info reports them; the API key hidden."""
        out = dataclasses.asdict(self)
        out["device"] = self.resolved_device()
        out["attention_backend"] = self.resolved_attention_backend()
        out["span_head_tokens"] = self.resolved_span_head_tokens()
        out["api_key"] = None if self.api_key is None else "<hidden>"
        return out

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server arguments: {', '.join(unknown)}")
        return cls(**kwargs)
