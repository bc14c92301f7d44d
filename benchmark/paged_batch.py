"""Random paged batches laid out like the engine's, and drivers that run the Triton kernels on them; shared by
the kernel tests and the benchmark.

Kernel modules are imported inside the drivers, so importing this module never imports triton (the CPU tests
must set TRITON_INTERPRET before that happens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_pic.forward_batch import BatchRows
from sglang_pic.kernels.paged_layout import ExtendRows, PagedKV, SpanScaling
from sglang_pic.kernels.reference import rope_f64
from sglang_pic.kv_cache_dtype import decode_tile_dtype
from sglang_pic.layers.rotary_embedding import RotaryEmbedding

if TYPE_CHECKING:
    from sglang_pic.forward_batch import ForwardBatch
    from sglang_pic.kernels.decode_attention import DecodeConfig
    from sglang_pic.kernels.extend_attention import ExtendConfig
    from sglang_pic.kernels.stage_keys import StagedKeys
    from sglang_pic.layers.attention_backend import AttentionBackend
    from sglang_pic.managers.shared_decode_planner import KeyRun, SharedDecodeSettings


@dataclass(frozen=True)
class RequestSpec:
    """One request: its length, the positions of its new tokens with their attn_lo, and where its KV segments
    start (each segment begins on a fresh page, like the engine's allocator)."""

    seq_len: int
    positions: tuple[int, ...]
    attn_lo: tuple[int, ...]
    segment_starts: tuple[int, ...] = (0,)


def prefill(seq_len: int) -> RequestSpec:
    return RequestSpec(seq_len, tuple(range(seq_len)), (0,) * seq_len)


def extend(seq_len: int, new: int) -> RequestSpec:
    """A cached prefix of seq_len - new tokens, then `new` tokens that see everything before them."""
    starts = tuple(sorted({0, seq_len - new}))
    return RequestSpec(seq_len, tuple(range(seq_len - new, seq_len)), (0,) * new, starts)


def decode(seq_len: int) -> RequestSpec:
    return RequestSpec(seq_len, (seq_len - 1,), (0,))


def spans(seq_len: int, new_spans: list[tuple[int, int]], tail: int) -> RequestSpec:
    """Span prefills [start, end) that see only their own span (attn_lo = start), cached text between them, and
    `tail` final tokens (a PDEP part) that see everything."""
    pos: list[int] = []
    lo: list[int] = []
    starts = {0, seq_len - tail}
    for start, end in new_spans:
        pos += range(start, end)
        lo += [start] * (end - start)
        starts |= {start, end}
    pos += range(seq_len - tail, seq_len)
    lo += [0] * tail
    return RequestSpec(seq_len, tuple(pos), tuple(lo), tuple(sorted(s for s in starts if s < seq_len)))


@dataclass
class PagedBatch:
    """A batch laid out like the engine's: shuffled pages, shuffled request rows, NaN in every unused KV slot
    except the dummy page. The new tokens' k/v are already in the pool (k_new, v_new hold them unrotated).
    `rows` holds the batch's integers on the host, the tensors below the same on the device."""

    rows: BatchRows
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    extend_seq_lens: torch.Tensor
    positions: torch.Tensor
    attn_lo: torch.Tensor
    out_cache_loc: torch.Tensor
    cos_sin_cache: torch.Tensor
    kernel_cos_sin: torch.Tensor  # cos_sin_cache in the pool's dtype, what the engine hands the kernels
    decode_cos_sin: torch.Tensor  # the same in the decode kernel's tile dtype (decode_tile_dtype)
    sm_scale: float
    page_size: int = 1
    staged: "StagedKeys | None" = None  # the key-staging workspace (NaN at first), built by the first staged run

    @property
    def seq_lens_cpu(self) -> list[int]:
        return self.rows.seq_lens

    @property
    def extend_seq_lens_cpu(self) -> list[int]:
        return self.rows.extend_seq_lens

    def kv(self, k_buffer: torch.Tensor | None = None) -> PagedKV:
        """The requests' keys (in k_buffer, by default the batch's own pool), with their longest context."""
        k_buffer = self.k_buffer if k_buffer is None else k_buffer
        return PagedKV(k_buffer, self.v_buffer, self.req_to_token, self.req_pool_indices, self.seq_lens,
                       max(self.seq_lens_cpu))

    def ext(self) -> ExtendRows:
        return ExtendRows(self.extend_start_loc, self.extend_seq_lens, self.positions, self.attn_lo,
                          max(self.extend_seq_lens_cpu))

    def attention_args(self, k_buffer: torch.Tensor | None = None) -> tuple:
        """Arguments shared by attention_reference and paged_attention_torch (keys from k_buffer if given)."""
        return self.q, self.kv(k_buffer), self.ext(), self.cos_sin_cache, self.sm_scale

    def poisoned_output(self) -> torch.Tensor:
        """[T, Hq, Dv] of NaN, so that a row the kernel forgets to write cannot pass a check."""
        shape = (self.q.shape[0], self.q.shape[1], self.v_buffer.shape[-1])
        return torch.full(shape, float("nan"), dtype=self.q.dtype, device=self.q.device)

    def query_rows(self) -> int:
        """The longest request's new tokens times the query heads per kv head (see should_stage_keys)."""
        return max(self.extend_seq_lens_cpu) * (self.q.shape[1] // self.k_buffer.shape[1])

    def run_extend(
        self,
        keys_rotated: bool = False,
        k_buffer: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        config: "ExtendConfig | None" = None,
        num_splits: int | None = None,
        stage: bool | None = None,
        span: SpanScaling | None = None,
    ) -> torch.Tensor:
        """The extend kernel over this batch (k_buffer defaults to the batch's own pool; `num_splits` key-range
        chunks, by default as many as the engine would pick on this device). Position-free keys are staged
        (rotated once into a workspace, see stage_keys) if `stage`, by default when the engine would. `span`
        scales the attention to span keys."""
        from sglang_pic.kernels.extend_attention import extend_attention_fwd
        from sglang_pic.kernels.stage_keys import should_stage_keys

        out = self.poisoned_output() if out is None else out
        kv = self.kv(k_buffer)
        if stage is None:
            stage = should_stage_keys(sum(self.seq_lens_cpu), kv.k_buffer, self.query_rows(), self.q.dtype)
        staged = self.stage_keys(kv.k_buffer) if stage and not keys_rotated else None
        extend_attention_fwd(
            self.q, out, kv, self.ext(), self.kernel_cos_sin, self.sm_scale, keys_rotated=keys_rotated, config=config,
            num_splits=num_splits, num_sms=_num_sms(self.q.device), staged_keys=staged, span=span,
        )
        return out

    def stage_keys(self, k_buffer: torch.Tensor | None = None) -> StagedKeys:
        """This batch's keys rotated once into a workspace, as the engine stages an extend's keys: the store writes
        the new tokens' keys there as it writes the pool (the same values again here), the staging pass the cached
        ones. The workspace and its row indices are built once per batch, as the engine builds them once per
        forward, and poisoned then, so a key neither pass writes reads as NaN."""
        from sglang_pic.kernels.stage_keys import alloc_staged_keys, has_cached_keys
        from sglang_pic.kernels.store_kv import store_kv

        kv = self.kv(k_buffer)
        if self.staged is None:
            self.staged = alloc_staged_keys(kv, self.ext(), sum(self.seq_lens_cpu), self.q.dtype)
            self.staged.workspace.fill_(float("nan"))
        new_kv = (self.out_cache_loc, self.k_new, self.v_new)
        store_kv(kv.k_buffer, self.v_buffer, *new_kv, self.kernel_cos_sin, self.staged, self.positions)
        if not has_cached_keys(self.seq_lens_cpu, self.extend_seq_lens_cpu):
            return self.staged
        return self.stage_cached_keys(kv.k_buffer)

    def stage_cached_keys(self, k_buffer: torch.Tensor | None = None) -> StagedKeys:
        """The staging pass alone: the cached keys into the workspace stage_keys built (benchmarks time it)."""
        from sglang_pic.kernels.stage_keys import stage_keys

        return stage_keys(self.staged, self.kv(k_buffer), self.ext(), self.kernel_cos_sin)

    def run_decode(
        self,
        max_splits: int,
        keys_rotated: bool = False,
        k_buffer: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        config: "DecodeConfig | None" = None,
    ) -> torch.Tensor:
        """The decode kernels over this batch of decode requests (one query each, at seq_len - 1)."""
        from sglang_pic.kernels.decode_attention import alloc_decode_buffers, decode_attention_fwd

        out = self.poisoned_output() if out is None else out
        if buffers is None:
            num_heads, v_dim = self.q.shape[1], self.v_buffer.shape[-1]
            buffers = alloc_decode_buffers(self.q.shape[0], num_heads, v_dim, max_splits, self.q.device)
        decode_attention_fwd(
            self.q, out, self.kv(k_buffer), self.decode_cos_sin, self.sm_scale, *buffers, keys_rotated=keys_rotated,
            config=config,
        )
        return out

    def share_keys(self, shares: list[tuple[int, int, int, list[tuple[int, int]]]]) -> list[list["KeyRun"]]:
        """Make requests hold the same slots at different offsets, as cached spans do: each share (source request,
        its first key, length, [(request, first key)]) copies the source's slots over the others' rows. Returns
        every request's runs (KeyRun lists, sorted) for plan_shared_decode."""
        from sglang_pic.managers.shared_decode_planner import KeyRun

        runs: list[list[KeyRun]] = [[] for _ in self.seq_lens_cpu]
        rows = self.req_pool_indices.tolist()
        for key, (source, first, length, copies) in enumerate(shares):
            slots = self.req_to_token[rows[source], first : first + length].clone()
            runs[source].append(KeyRun(key, first, length))
            for b, start in copies:
                self.req_to_token[rows[b], start : start + length] = slots
                runs[b].append(KeyRun(key, start, length))
        return [sorted(r, key=lambda run: run.start) for r in runs]

    def run_shared_decode(self, runs: list[list["KeyRun"]], settings: "SharedDecodeSettings") -> torch.Tensor:
        """The shared decode kernels (kernels/shared_decode.py) over this batch of decode requests."""
        from sglang_pic.kernels.shared_decode import shared_decode_attention_fwd
        from sglang_pic.managers.shared_decode_planner import plan_shared_decode

        out = self.poisoned_output()
        plan = plan_shared_decode(self.req_pool_indices.tolist(), self.seq_lens_cpu, runs, settings, self.q.device)
        shared_decode_attention_fwd(self.q, out, self.kv(), plan, self.kernel_cos_sin, self.sm_scale)
        return out

    def run_store(self, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k_new/v_new into NaN-filled copies of the pools (rotating keys by position for the baseline)."""
        from sglang_pic.kernels.store_kv import store_kv, store_kv_rotated

        k_buf = torch.full(self.k_buffer.shape, float("nan")).to(self.k_buffer)  # fp8 pools take no fill
        v_buf = torch.full(self.v_buffer.shape, float("nan")).to(self.v_buffer)
        loc = self.out_cache_loc
        if rotate:
            store_kv_rotated(k_buf, v_buf, loc, self.k_new, self.v_new, self.positions, self.cos_sin_cache)
        else:
            store_kv(k_buf, v_buf, loc, self.k_new, self.v_new, self.cos_sin_cache)
        return k_buf, v_buf

    def rotated_pool(self) -> torch.Tensor:
        """The key buffer as a standard engine keeps it: every live slot rotated by its token index."""
        k_rot = self.k_buffer.clone()
        for b, seq_len in enumerate(self.seq_lens_cpu):
            slots = self.req_to_token[self.req_pool_indices[b], :seq_len]
            idx = torch.arange(seq_len, device=slots.device)
            k_rot[slots] = rope_f64(self.k_buffer[slots], idx, self.cos_sin_cache).to(k_rot.dtype)
        return k_rot


def _segments(spec: RequestSpec) -> list[tuple[int, int]]:
    bounds = list(spec.segment_starts) + [spec.seq_len]
    return list(zip(bounds[:-1], bounds[1:]))


def _slot_table(spec: RequestSpec, page_size: int, pages: torch.Tensor, next_page: int) -> tuple[torch.Tensor, int]:
    """Slots of tokens 0..seq_len-1, each segment filling fresh pages taken in order from pages[next_page:];
    also returns the first page still unused."""
    parts = []
    for start, end in _segments(spec):
        i = torch.arange(end - start)
        parts.append(pages[next_page + i // page_size] * page_size + i % page_size)
        next_page += -(-(end - start) // page_size)
    return torch.cat(parts), next_page


def make_paged_batch(
    specs: list[RequestSpec],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    page_size: int = 1,
    rotary_dim: int | None = None,
    v_head_dim: int | None = None,
    rope_base: float = 10000.0,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Random q and KV for `specs`, the pool in `kv_dtype` (default: `dtype`; the new tokens' k_new and v_new are
    its values widened to `dtype`). Slots that no request owns hold NaN, and every request's req_to_token row
    points past its length at such a slot, so a kernel that reads outside its keys produces NaN."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    v_head_dim = v_head_dim or head_dim
    max_len = max(s.seq_len for s in specs)
    need_pages = sum(-(-(e - s) // page_size) for sp in specs for s, e in _segments(sp))
    num_pages = need_pages + 2  # the dummy page 0 and one page nobody owns
    pages = torch.randperm(num_pages - 1, generator=gen) + 1
    pool_rows = torch.randperm(len(specs) + 3, generator=gen)[: len(specs)].tolist()

    poison_slot = int(pages[-1]) * page_size
    req_to_token = torch.full((len(specs) + 3, max_len + page_size), poison_slot, dtype=torch.int64)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    loc_parts = []
    next_page = 0
    rows = BatchRows()
    for spec, row in zip(specs, pool_rows):
        slots, next_page = _slot_table(spec, page_size, pages, next_page)
        req_to_token[row, : spec.seq_len] = slots
        owned[slots] = True
        loc_parts.append(slots[list(spec.positions)])
        rows.add(row, list(spec.positions), list(spec.attn_lo), spec.seq_len)

    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    buffers = []
    for dim in (head_dim, v_head_dim):
        buf = torch.randn((owned.shape[0], num_kv_heads, dim), generator=dev_gen, device=device, dtype=dtype)
        buf[~owned.to(device)] = float("nan")
        buf[:page_size] = 0
        buffers.append(buf.to(kv_dtype or dtype))
    k_buffer, v_buffer = buffers

    def on_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    ext = torch.tensor(rows.extend_seq_lens, dtype=torch.int64)
    loc = torch.cat(loc_parts).to(device)
    q = torch.randn((rows.num_tokens, num_heads, head_dim), generator=dev_gen, device=device, dtype=dtype)
    rope = RotaryEmbedding(head_dim, max_len + 1, base=rope_base, rotary_dim=rotary_dim, device=device)
    return PagedBatch(
        rows=rows,
        q=q,
        k_new=k_buffer[loc].to(dtype),
        v_new=v_buffer[loc].to(dtype),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token.to(device),
        req_pool_indices=on_device(rows.req_pool_indices),
        seq_lens=on_device(rows.seq_lens),
        extend_start_loc=(torch.cumsum(ext, 0) - ext).to(device),
        extend_seq_lens=ext.to(device),
        positions=on_device(rows.positions),
        attn_lo=on_device(rows.attn_lo),
        out_cache_loc=loc,
        cos_sin_cache=rope.cos_sin_cache,
        kernel_cos_sin=rope.kernel_table(dtype),
        decode_cos_sin=rope.kernel_table(decode_tile_dtype(k_buffer.dtype, dtype)),
        sm_scale=head_dim**-0.5,
        page_size=page_size,
    )


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def forward_batch_for(
    batch: PagedBatch, backend: "AttentionBackend", decode: bool, decode_tail: int = 0
) -> "ForwardBatch":
    """Engine-side view of `batch` for one backend: its own one-layer pools, with the new tokens' slots poisoned
    so that the backend has to store their k/v itself before attending. `decode_tail`: in an extend batch, how many
    trailing requests are decodes riding along (ForwardBatch.num_decode_tail)."""
    from sglang_pic.forward_batch import ForwardBatch, ForwardMode
    from sglang_pic.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    device = batch.q.device
    slots, kv_heads, head_dim = batch.k_buffer.shape
    page = batch.page_size
    v_dim = batch.v_buffer.shape[-1]
    kv_pool = MHATokenToKVPool(slots - page, page, batch.k_buffer.dtype, kv_heads, head_dim, 1, device, v_dim)
    kv_pool.k_buffer[0].copy_(batch.k_buffer)
    kv_pool.v_buffer[0].copy_(batch.v_buffer)
    kv_pool.k_buffer[0][batch.out_cache_loc] = float("nan")
    kv_pool.v_buffer[0][batch.out_cache_loc] = float("nan")
    req_pool = ReqToTokenPool(batch.req_to_token.shape[0], batch.req_to_token.shape[1], device)
    req_pool.req_to_token[: batch.req_to_token.shape[0]].copy_(batch.req_to_token)
    return ForwardBatch.build(
        ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch.rows, batch.out_cache_loc, device,
        req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, attn_backend=backend,
        input_ids=torch.zeros(batch.q.shape[0], dtype=torch.int64, device=device), num_decode_tail=decode_tail,
    )
