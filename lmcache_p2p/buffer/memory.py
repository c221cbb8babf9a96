"""The memory behind the receive buffer: one allocation, made once at start.

Host buffers are anonymous mappings advised as transparent huge pages: UCX shared memory copies
with CMA (process_vm_writev), which walks the receiver's pages one by one; with 2 MiB pages it
ran about twice as fast here as with 4 KiB pages (bench/transfer.py, --no-hugepages).
Device buffers are a plain ``torch.empty`` on the device.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Memory:
    """A contiguous uint8 tensor of ``nbytes``; keep this object alive as long as the tensor is used."""

    def __init__(self, nbytes: int, device: str = "cpu", *, hugepages: bool = True) -> None:
        import torch

        self._mapping: mmap.mmap | None = None
        if device == "cpu" and hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._mapping.madvise(mmap.MADV_HUGEPAGE)
            self.tensor: torch.Tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
            self.tensor.zero_()  # fault the pages in now (as huge pages), not on the first transfer
        else:
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    @property
    def hugepages(self) -> bool:
        return self._mapping is not None
