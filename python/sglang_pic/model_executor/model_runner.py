"""Owns the model, the KV pools and the attention backend; runs one ForwardBatch and samples its next tokens.

Under tensor parallelism every rank has a runner holding its shard of the model and a KV pool of its own KV heads;
rank 0's runner sends each batch to the others before running it (see batch_broadcast).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from sglang_pic.distributed.parallel_state import get_tp_group, min_over_ranks
from sglang_pic.distributed.sharding import kv_head_shard
from sglang_pic.forward_batch import BatchRows, ForwardBatch, ForwardMode
from sglang_pic.kv_cache_dtype import FP8_DTYPES, kv_storage_dtype
from sglang_pic.layers.attention_registry import create_attention_backend
from sglang_pic.layers.radix_attention import RadixAttention
from sglang_pic.mem_cache.allocator import TokenToKVPoolAllocator
from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang_pic.model_config import ModelConfig
from sglang_pic.model_executor.batch_broadcast import BatchBroadcaster
from sglang_pic.model_executor.step_sampler import SampledOutput, StepSampler, StepSampling
from sglang_pic.model_loader.loader import (
    checkpoint_weights, init_dummy_weights, iter_safetensors, load_model, resolve_model_path,
)
from sglang_pic.quant_config import resolve_quantization
from sglang_pic.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
CALIBRATION_TOKENS = 512  # the start-up forward that fixes an fp8 pool's scales


class DraftMemory(Protocol):
    """Device memory that speculative drafts take beside the KV pool (a VeriCache compressor's quantized copies)."""

    def bytes_per_token_outside_pool(self, num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int) -> int: ...


class ModelRunner:
    def __init__(
        self, server_args: ServerArgs, model_config: ModelConfig, draft_memory: DraftMemory | None = None
    ) -> None:
        """`draft_memory`: what the speculative algorithm keeps on the device per pool token (None: nothing)."""
        self.server_args = server_args
        self.model_config = model_config
        self.draft_memory = draft_memory
        self.device = torch.device(server_args.resolved_device())
        self.dtype = model_config.dtype
        self.tp = get_tp_group()
        torch.manual_seed(server_args.random_seed)
        start = time.perf_counter()
        logger.info("loading the model from %s onto %s (%s)", model_config.model_path, self.device, self.dtype)
        self.model = load_model(
            model_config, server_args.load_format, self.device, self.dtype, server_args.random_seed,
            server_args.span_adapter, server_args.span_adapter_scope,
        )
        self.model.eval()
        logger.info("model loaded in %.1f s", time.perf_counter() - start)
        # Where the served weights come from (None: random dummy weights) and the span adapter merged into them:
        # updates that fail load them back. Weights loaded by an update are served as they are (an adapter kept
        # apart from the weights stays on for span requests).
        self._weights_folder = None if server_args.load_format == "dummy" else model_config.model_path
        self._weights_adapter = None if server_args.span_adapter_apart() else server_args.span_adapter
        self._init_memory_pools()
        self.sampler = StepSampler(model_config.vocab_size, self.device, self.req_to_token_pool.req_to_token.shape[0])
        self.attn_backend = create_attention_backend(
            server_args.resolved_attention_backend(), self._attention_layer(), model_config,
            speculative=server_args.speculative_algorithm is not None,
        )
        self.shared_decode_heads = self._shared_decode_heads()
        self._calibrate_kv_scales()
        if self.device.type == "cuda" and not server_args.skip_kernel_warmup:
            self._warm_up_kernels()
        self.graph_runner = None
        use_graphs = server_args.resolved_attention_backend() != "torch_native" and not server_args.disable_cuda_graph
        if self.device.type == "cuda" and use_graphs:
            from sglang_pic.model_executor.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner.for_engine(self)
        self.broadcaster = BatchBroadcaster(self) if self.tp.size > 1 and self.tp.rank == 0 else None

    def _calibrate_kv_scales(self) -> None:
        """An fp8 pool's per-layer key and value scales (kv_cache_dtype.py), from one forward over fixed
        pseudo-random tokens: the same scales on every start, so a cache never mixes units. Every tensor-parallel
        rank runs it at this point of its start, so their collectives meet; each scales its own heads. Weights
        updated later (a checkpoint of the same model) keep these scales, whose headroom is 2-4x."""
        pool = self.token_to_kv_pool
        if pool.dtype not in FP8_DTYPES:
            return
        n = min(CALIBRATION_TOKENS, self.allocator.available_size(), self.model_config.context_len)
        ids = torch.randint(self.model_config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        with self.scratch_prefill(ids.tolist()) as batch:  # the pool is empty at start: there is room
            pool.start_calibration()
            self.forward_with(batch, None)
            pool.finish_calibration()
        logger.info("fp8 KV scales over %d tokens: keys %s, values %s", n,
                    sorted(set(pool.k_scale)), sorted(set(pool.v_scale)))

    @contextmanager
    def scratch_prefill(self, ids: list[int], span_adapter: bool = False) -> Iterator[ForwardBatch | None]:
        """A one-request prefill batch of `ids` at positions 0 .., in a request row and KV slots of its own, freed
        on exit: for passes that keep only what the forward measures (calibration, deviation). None when no row
        or too few slots are free. `span_adapter`: its rows run under the span adapter."""
        n = len(ids)
        row = self.req_to_token_pool.alloc()
        slots = None if row is None else self.allocator.alloc(n)
        if slots is None:
            if row is not None:
                self.req_to_token_pool.free(row)
            yield None
            return
        try:
            self.req_to_token_pool.write(row, slice(0, n), slots)
            rows = BatchRows(input_ids=ids)
            rows.add(row, range(n), [0] * n, span_adapter=span_adapter)
            yield ForwardBatch.build(ForwardMode.EXTEND, rows, slots, self.device,
                                     req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
                                     attn_backend=self.attn_backend)
        finally:
            self.allocator.free(slots)
            self.req_to_token_pool.free(row)

    def _shared_decode_heads(self) -> tuple[int, int] | None:
        """(query heads, KV heads) of this rank when decode steps may share the reads of KV runs that several
        requests hold (shared decode attention, planned by the scheduler); None: each request reads its own."""
        if self.server_args.resolved_attention_backend() != "triton" or self.server_args.disable_shared_decode:
            return None
        return self.model_config.num_attention_heads // self.tp.size, self.token_to_kv_pool.head_num

    def _attention_layer(self) -> RadixAttention:
        """The model's first attention layer: every layer has its shape."""
        return next(m for m in self.model.modules() if isinstance(m, RadixAttention))

    def _warm_up_kernels(self) -> None:
        layer = self._attention_layer()
        start = time.perf_counter()
        launches = self.attn_backend.warm_up(layer, self.token_to_kv_pool, self.req_to_token_pool, self.dtype)
        torch.cuda.synchronize(self.device)
        logger.info("warmed up %d attention kernel variants in %.1f s", launches, time.perf_counter() - start)

    def _init_memory_pools(self) -> None:
        cfg = self.model_config
        page = self.server_args.page_size
        kv_heads = kv_head_shard(cfg.num_key_value_heads, self.tp.rank, self.tp.size).size
        kv_dtype = kv_storage_dtype(self.server_args.kv_cache_dtype, self.dtype)
        probe = MHATokenToKVPool(0, page, kv_dtype, kv_heads, cfg.head_dim, cfg.num_hidden_layers, "meta")
        kv_per_token = probe.bytes_per_token()
        per_token = kv_per_token + self._draft_bytes_per_token(kv_heads)
        size = self.server_args.max_total_tokens
        if size is None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # memory cached by the allocator (an earlier engine's, say) is free to us
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - total * (1 - self.server_args.mem_fraction_static)
                size = int(max(budget, 0) // per_token)
                if size < cfg.context_len // 4:
                    raise RuntimeError(
                        f"only {size} KV tokens fit in GPU memory ({free / 2**30:.1f} GiB free); raise "
                        "--mem-fraction-static, set --max-total-tokens, or free the GPU"
                    )
            else:
                size = CPU_DEFAULT_MAX_TOTAL_TOKENS
        size = max(min_over_ranks(size) // page * page, page)  # every rank must hold rank 0's slot indices
        self.max_total_num_tokens = size
        self.token_to_kv_pool = MHATokenToKVPool(
            size, page, kv_dtype, kv_heads, cfg.head_dim, cfg.num_hidden_layers, self.device
        )
        self.allocator = TokenToKVPoolAllocator(size, page, self.device)
        # Twice the running set: a step's prefills (span jobs, new requests) get rows even while every running
        # seat is taken, so span prefills keep their full token budget next to a full decode batch.
        rows = 2 * self.server_args.max_running_requests + 8
        self.req_to_token_pool = ReqToTokenPool(rows, cfg.context_len + page, self.device)
        logger.info("KV pool: %d tokens (%.2f GiB, %s), %d request rows", size, size * kv_per_token / 2**30,
                    str(kv_dtype).removeprefix("torch."), rows)

    def _draft_bytes_per_token(self, kv_heads: int) -> int:
        """Device memory a pool token may also take outside the pool for VeriCache drafts (KIVI keeps a 2-bit copy
        of every request's older tokens), so a pool sized from free memory leaves room for it. With the full KV in
        host memory the copies of host-tier tokens can still outgrow that room."""
        if self.draft_memory is None:
            return 0
        layers, head_dim = self.model_config.num_hidden_layers, self.model_config.head_dim
        return self.draft_memory.bytes_per_token_outside_pool(layers, kv_heads, head_dim, head_dim)

    def forward(self, batch: ForwardBatch, sampling: StepSampling) -> SampledOutput:
        """Run the batch and sample its next tokens on the device (step_sampler.py); rank 0 first sends the batch to
        its followers, which run only the forward."""
        if self.broadcaster is not None:
            self.broadcaster.send(batch)
        return self.sampler.sample(self.forward_local(batch), sampling)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> None:
        """Load another checkpoint of the served architecture and shapes into the model's parameters, in place, so
        captured CUDA graphs keep pointing at them. Raises ValueError naming the problem; when loading fails part
        way, the previous weights are loaded back first."""
        if load_format not in (None, "auto", "gguf"):
            raise ValueError(f"load_format must be auto or gguf, got {load_format!r}")
        try:
            folder = resolve_model_path(model_path, load_format or "auto")
            config = ModelConfig.from_server_args(folder, self.server_args)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"cannot read {model_path!r}: {e}") from None
        # Dense weights load into fp8 layers quantized, as at start; fp8 ones need fp8 layers.
        config.quantization = resolve_quantization(self.model_config.quantization, config.hf_config)
        differences = self.model_config.differences(config)
        if differences:
            raise ValueError(f"{model_path!r} is not the served model's architecture: {'; '.join(differences)}")
        if self.broadcaster is not None:
            self.broadcaster.load_weights(folder)
        self.load_weights_on_all_ranks(folder)

    def load_weights_on_all_ranks(self, folder: str) -> None:
        """Every tensor-parallel rank loads its shard of `folder` (rank 0 has told the others to); when any rank
        fails, all load their previous weights back and ValueError says why."""
        error = None
        try:
            self.model.load_weights(iter_safetensors(folder))
        except Exception as e:
            error = e
        if min_over_ranks(int(error is None)) == 0:
            self._load_previous_weights()
            why = error or "on another tensor-parallel rank"
            raise ValueError(f"loading {folder!r} failed ({why}); the previous weights are back") from None
        self._weights_folder, self._weights_adapter = folder, None

    def _load_previous_weights(self) -> None:
        if self._weights_folder is None:
            init_dummy_weights(self.model, self.server_args.random_seed)
        else:
            self.model.load_weights(checkpoint_weights(self._weights_folder, self._weights_adapter))

    def shutdown(self) -> None:
        """Release the tensor-parallel followers (they leave their receive loop)."""
        if self.broadcaster is not None:
            self.broadcaster.stop()
            self.broadcaster = None

    def forward_local(self, batch: ForwardBatch) -> torch.Tensor:
        """This rank's forward (its collectives included), without sending the batch anywhere."""
        logits = self.forward_with(batch, self.graph_runner)
        group = self.tp.device_group if self.tp.size > 1 else None
        if batch.probe is not None:
            batch.probe.finish(group)
        if batch.deviation is not None:
            batch.deviation.finish(group)
        return logits

    def forward_deviation(self, batch: ForwardBatch) -> torch.Tensor:
        """A deviation pass (managers/span_deviation.py) on every rank; its scores, summed over the ranks."""
        if self.broadcaster is not None:
            self.broadcaster.send(batch)
        self.forward_local(batch)
        return batch.deviation.scores

    @torch.inference_mode()
    def forward_with(self, batch: ForwardBatch, graph_runner, prepared: bool = False) -> torch.Tensor:
        """Logits of `batch`, replayed by `graph_runner` (None: never) when it holds a graph for the batch, else run
        eagerly on the batch's attention backend, whose metadata is set up here unless `prepared`.

        The graph runner must be one captured over the batch's own request table and backend: VeriCache passes
        its draft graphs for draft steps and none for verification (the engine's graphs would replay any batch of
        their shape over the engine's table and backend)."""
        if graph_runner is not None and graph_runner.can_run(batch):
            hidden = graph_runner.replay(batch)
        else:
            if not prepared:
                batch.attn_backend.init_forward_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_indices is None or batch.logits_indices.numel() == 0:
            return torch.empty((0, self.model_config.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()
