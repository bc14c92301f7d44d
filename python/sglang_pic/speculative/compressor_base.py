"""The interface every VeriCache compressor implements, and the registry that finds one by name.

A compressor turns a request's full KV into a draft cache (see draft_cache.py). Token-dropping compressors pick
which tokens to keep (`select`); the worker then lists the kept tokens' slots as the draft's rows, so nothing is
copied while the full KV sits in device memory. A quantizing compressor (KIVI) overrides `build` and `refresh` to
keep its own storage. A new compressor is one module, compress_<name>.py, whose class subclasses `Compressor`
and is decorated with `register`.

Verification is exact whatever the draft sees, so a compressor only trades draft quality (acceptance) against
draft cost; none of its choices can change the output.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from sglang_pic.layers.attention_backend import AttentionBackend
from sglang_pic.speculative.draft_cache import DraftBackend, DraftBatch, DraftCache, LayerTableBackend

# A draft is recompressed once it has grown by this fraction of its budget (and at least MIN_REFRESH tokens),
# so the tokens it appends between compressions stay a bounded share of it.
REFRESH_FRACTION = 0.5
MIN_REFRESH = 32


class KVSource(Protocol):
    """Read access to one request's full KV, for building its draft cache."""

    num_tokens: int  # tokens 0..num_tokens-1 have KV
    num_layers: int
    pool: Any  # the device KV pool whose slots draft rows hold

    def rows_for(self, index: torch.Tensor) -> torch.Tensor:
        """Device slots holding tokens `index` ([Lr, m] logical indices, per layer or shared) for drafting.

        Returns [Lr', m]: the full KV's own slots when it lives in device memory (no copy), else fresh slots the
        tokens were copied into (then one row whose slot j holds, at each layer, that layer's j-th token).
        """
        ...

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unrotated keys and values [m, Hkv, D] of tokens `index` at `layer`, on the device."""
        ...


def refresh_threshold(budget: int) -> int:
    """Tokens a draft may append after its last compression before it is compressed again."""
    return max(MIN_REFRESH, int(budget * REFRESH_FRACTION))


def resolve_budget(budget: float, num_tokens: int) -> int:
    """Tokens a draft keeps for a context of `num_tokens`: a ratio below 1, a token count from 1 up."""
    if budget <= 0:
        raise ValueError(f"vericache_budget must be positive, got {budget}")
    return max(1, math.ceil(budget * num_tokens)) if budget < 1 else int(budget)


class Compressor:
    name: ClassVar[str]

    def new_state(self) -> Any:
        """Per-request state kept across compressions (e.g. H2O's accumulated scores)."""
        return None

    def observation(self, state: Any, num_tokens: int) -> int:
        """How many trailing tokens' attention the compressor wants scored before it compresses (0: none)."""
        return 0

    def select(self, num_tokens: int, budget: int, scores: torch.Tensor | None, state: Any) -> torch.Tensor:
        """Kept token indices [Lr, min(budget, num_tokens)], ascending per row.

        `scores` [layers, Hkv, num_tokens] holds the observed queries' attention probabilities summed per key.
        """
        raise NotImplementedError(f"{type(self).__name__} does not select tokens")

    def bytes_per_token_outside_pool(self, num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int) -> int:
        """Device memory a pool token may also need outside the KV pool for this compressor's drafts (token
        dropping keeps drafts in pool slots: none)."""
        return 0

    def max_draft_tokens(self, num_tokens: int, budget: int) -> int:
        """Most full-precision draft rows `build` may need (bounds the slots a copying KV source allocates)."""
        return min(budget, num_tokens)

    def build(
        self, src: KVSource, budget: int, scores: torch.Tensor | None, state: Any, device: torch.device
    ) -> DraftCache:
        index = self.select(src.num_tokens, budget, scores, state)
        assert index.shape[-1] == min(budget, src.num_tokens), f"{self.name} broke its budget"
        rows = src.rows_for(index.to(device))
        return DraftCache.from_rows(rows, covered=src.num_tokens, state=state)

    def needs_refresh(self, draft: DraftCache, budget: int) -> bool:
        return draft.appended >= refresh_threshold(budget)

    def refresh(
        self, draft: DraftCache, src: KVSource, budget: int, scores: torch.Tensor | None, device: torch.device
    ) -> DraftCache:
        """A compressed draft of the request's current KV (by default: compress again from scratch)."""
        return self.build(src, budget, scores, draft.state, device)

    def draft_backend(self, inner: AttentionBackend, batch: DraftBatch, pool) -> DraftBackend:
        """The attention backend eager draft forwards of `batch` use: the engine's own, reading each layer's rows."""
        return LayerTableBackend(inner, batch.tables)

    def drafts_on_static_tables(self, inner: AttentionBackend) -> bool:
        """Whether draft steps can run over static tables (which CUDA graphs replay) with the engine's backend."""
        return True

    def static_draft_backend(self, inner: AttentionBackend, tables: torch.Tensor, pool) -> DraftBackend:
        """The backend for draft steps over static tables [layers, rows, width]."""
        return LayerTableBackend(inner, tables)


COMPRESSORS: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    COMPRESSORS[cls.name] = cls
    return cls


def create_compressor(name: str) -> Compressor:
    """Every compress_*.py module of this package registers its compressor when imported."""
    package = Path(__file__).parent
    for module in pkgutil.iter_modules([str(package)]):
        if module.name.startswith("compress_"):
            importlib.import_module(f"{__package__}.{module.name}")
    if name not in COMPRESSORS:
        raise ValueError(f"unknown vericache_compressor {name!r}; choose from {', '.join(sorted(COMPRESSORS))}")
    return COMPRESSORS[name]()
