"""Free-list allocator of KV slots, page-granular.

Slots are handed out by pages of `page_size`; slot s lives in page s // page_size. Page 0 is reserved (dummy
slot 0). A segment of a request (a prefix, a span, a PDEP part) always starts on a fresh page and then fills its
pages in order, so a segment's first n tokens own whole pages and can be shared through the radix tree.
"""

from __future__ import annotations

import torch

from sglang_pic.utils_tensor import host_tensor


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int, device: str | torch.device) -> None:
        if size % page_size:
            size -= size % page_size
        self.size = size
        self.page_size = page_size
        self.device = device
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        # Pages 1..num_pages are usable; page 0 holds the dummy slot.
        self.free_pages: list[int] = list(range(self.num_pages, 0, -1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        if n > len(self.free_pages):
            return None
        taken = self.free_pages[len(self.free_pages) - n :]
        del self.free_pages[len(self.free_pages) - n :]
        return taken[::-1]

    def alloc(self, need: int, last_slot: int = -1) -> torch.Tensor | None:
        """Slots for `need` more tokens of a segment whose last slot is `last_slot` (-1: the segment starts here)."""
        slots = self.alloc_host(need, last_slot)
        return None if slots is None else slots.to(self.device)

    def alloc_host(self, need: int, last_slot: int = -1) -> torch.Tensor | None:
        """`alloc` with the slots left on the host, for callers that read them or upload several at once."""
        ps = self.page_size
        head = 0 if last_slot < 0 else (ps - 1 - last_slot % ps)
        head = min(head, need)
        rest = need - head
        pages = self.alloc_pages((rest + ps - 1) // ps)
        if pages is None:
            return None
        slots = host_tensor(pages)
        if ps > 1:
            slots = (slots[:, None] * ps + torch.arange(ps)).flatten()[:rest]
        if head:
            slots = torch.cat([torch.arange(last_slot + 1, last_slot + 1 + head, dtype=torch.int64), slots])
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding `slots`. Callers pass whole pages they own (a segment's tail is a page it owns)."""
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.cpu() // self.page_size).tolist()
        self.free_pages.extend(pages)
