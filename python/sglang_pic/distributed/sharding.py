"""Which slice of each full checkpoint tensor a tensor-parallel rank holds: one rule, shared by layers and pools."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a dimension whose full (checkpoint) length is `full`."""

    full: int
    start: int
    size: int


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor parallelism: {what} ({total}) is not divisible by tp_size {parts}")
    return total // parts


def even_shard(total: int, rank: int, size: int, what: str) -> Shard:
    per = divide(total, size, what)
    return Shard(total, rank * per, per)


def kv_head_shard(num_kv_heads: int, rank: int, size: int) -> Shard:
    """KV heads of `rank`, in heads. With fewer KV heads than ranks each rank holds one, and ranks
    r*kv//size share it: exactly the KV head its query heads (an even split of all query heads) attend to."""
    if num_kv_heads >= size:
        return even_shard(num_kv_heads, rank, size, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(
            f"tensor parallelism: tp_size {size} is neither a divisor nor a multiple of num_key_value_heads "
            f"{num_kv_heads}"
        )
    return Shard(num_kv_heads, rank * num_kv_heads // size, 1)


def vocab_shard(vocab_size: int, rank: int, size: int) -> Shard:
    """An equal share of the vocabulary rounded up, so every rank's table (and logits slice) has the same shape;
    the last rank's rows past the vocabulary are padding."""
    per = -(-vocab_size // size)
    return Shard(vocab_size, rank * per, per)
