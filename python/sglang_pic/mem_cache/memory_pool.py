"""Memory pools: the request-to-token table and the per-layer KV tensors.

Slot 0 of the KV pool is a dummy that padded rows write to; real slots are 1..size. Keys are stored unrotated.
"""

from __future__ import annotations

import torch

from sglang_pic.kv_cache_dtype import power_of_two_scale, to_kv_dtype


class ReqToTokenPool:
    """req_to_token[r, j] = KV slot of logical token j of the request living in row r."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        # One extra row, never handed out and all zeros (the dummy KV slot), for padded rows of CUDA graphs.
        self.padding_row = size
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int64, device=device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, index: int) -> None:
        self.free_slots.append(index)

    def write(self, index: int, positions: torch.Tensor | slice, slots: torch.Tensor) -> None:
        self.req_to_token[index, positions] = slots

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """Per-layer key and value buffers of shape [size + page_size, num_kv_heads, head_dim], holding k / k_scale[l]
    and v / v_scale[l] (powers of two, 1.0 unless calibrated for an fp8 pool: see kv_cache_dtype.py)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
        v_head_dim: int | None = None,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.layer_num = layer_num
        self.device = device
        rows = size + page_size
        self.k_buffer = [torch.zeros((rows, head_num, head_dim), dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [
            torch.zeros((rows, head_num, self.v_head_dim), dtype=dtype, device=device) for _ in range(layer_num)
        ]
        self.k_scale = [1.0] * layer_num
        self.v_scale = [1.0] * layer_num
        # While calibrating: each layer's largest |k| and |v| so far ([layers, 2], on the device); else None.
        self.calibration: torch.Tensor | None = None

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k and v, given in the pool's scaled units (as to_storage gives them), to slots `loc`."""
        self.k_buffer[layer_id][loc] = to_kv_dtype(k, self.dtype)
        self.v_buffer[layer_id][loc] = to_kv_dtype(v, self.dtype)

    def to_storage(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys and values in the units layer `layer_id` stores (divided by its scales; exact, powers of two),
        recording their magnitudes while calibrating."""
        if self.calibration is not None:
            seen = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
            torch.maximum(self.calibration[layer_id], seen, out=self.calibration[layer_id])
        ks, vs = self.k_scale[layer_id], self.v_scale[layer_id]
        return (k if ks == 1.0 else k * (1.0 / ks)), (v if vs == 1.0 else v * (1.0 / vs))

    def start_calibration(self) -> None:
        self.calibration = torch.zeros((self.layer_num, 2), dtype=torch.float32, device=self.device)

    def finish_calibration(self) -> None:
        """Fix each layer's scales from the magnitudes recorded since start_calibration."""
        for layer, (k_max, v_max) in enumerate(self.calibration.tolist()):
            self.k_scale[layer] = power_of_two_scale(k_max, self.dtype)
            self.v_scale[layer] = power_of_two_scale(v_max, self.dtype)
        self.calibration = None

    def bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.layer_num * self.head_num * (self.head_dim + self.v_head_dim) * elem
