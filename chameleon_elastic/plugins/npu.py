"""Ascend NPU back-end: hccl through ``torch_npu`` (optional extra ``chameleon-elastic[npu]``).

``torch_npu`` registers the ``npu`` device type and the ``hccl`` process-group backend when it
is imported, so it is imported here lazily, on first use, and only on hosts that have it.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import DeviceBackend, MemoryStats, PluginError

__all__ = ["NpuBackend"]


class NpuBackend(DeviceBackend):
    name = "npu"
    dist_backend = "hccl"

    def _torch_npu(self) -> Any | None:
        try:
            return importlib.import_module("torch_npu")
        except ImportError:
            return None
        except Exception as exc:  # a broken CANN install raises all sorts of errors
            raise PluginError(
                f"torch_npu is installed but failed to import ({exc}); check the CANN toolkit "
                "environment (source set_env.sh) or uninstall torch_npu."
            ) from exc

    def is_available(self) -> bool:
        if self._torch_npu() is None:
            return False
        import torch

        npu = getattr(torch, "npu", None)
        return bool(npu is not None and npu.is_available())

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        import torch

        return int(torch.npu.device_count())

    def device(self, local_rank: int = 0):
        import torch

        self._require()
        return torch.device("npu", self._check_rank(local_rank))

    def memory_stats(self, local_rank: int = 0) -> MemoryStats:
        import torch

        dev = self.device(local_rank)
        npu = torch.npu
        return MemoryStats(
            device=str(dev),
            allocated=int(npu.memory_allocated(dev)),
            peak=int(npu.max_memory_allocated(dev)),
            reserved=int(npu.memory_reserved(dev)),
            total=int(npu.get_device_properties(dev).total_memory),
        )

    def synchronize(self, local_rank: int = 0) -> None:
        import torch

        torch.npu.synchronize(self.device(local_rank))
