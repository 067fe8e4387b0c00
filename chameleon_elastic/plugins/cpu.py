"""CPU back-end: gloo, and process memory as the device memory.

On CPU there is no allocator to ask, so the figures are the process's: resident set size now
(``allocated`` and ``reserved``), the peak resident set size the kernel recorded, and the host's
physical memory as ``total``. Peak tracking cannot be reset on CPU.
"""

from __future__ import annotations

import os
import resource
import sys

import psutil

from .base import DeviceBackend, MemoryStats

__all__ = ["CpuBackend"]


class CpuBackend(DeviceBackend):
    name = "cpu"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int = 0):
        import torch

        return torch.device("cpu")

    def through_host(self, dist_backend: str) -> bool:
        return False   # host memory already

    def memory_stats(self, local_rank: int = 0) -> MemoryStats:
        rss = psutil.Process(os.getpid()).memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
        return MemoryStats(
            device="cpu",
            allocated=int(rss),
            peak=int(max(peak, rss)),
            reserved=int(rss),
            total=int(psutil.virtual_memory().total),
        )
