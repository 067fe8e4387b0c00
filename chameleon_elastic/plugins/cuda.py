"""CUDA back-end: nccl (plus gloo for CPU tensors), one GPU per local rank, figures from
torch's caching allocator.

Which NCCL: torch 2.15 builds its new nccl2 backend (``ProcessGroupNCCL2``, on the torchcomms
engine) for the name ``nccl``, 2.14 builds it for ``nccl2`` only, and both keep the classic
``ProcessGroupNCCL`` as ``nccl-legacy``. The back-end is made with one of those names
(``get_backend("nccl-legacy")``, or ``CHAMELEON_BACKEND=nccl-legacy`` for a job's workers);
``nccl``, the default, is whichever torch builds for it. How groups are then made on each
(device binding, ``new_group`` or ``split_group``) is decided in runtime/world/groups.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleon_elastic import torch_compat

from .base import DeviceBackend, MemoryStats, PluginError

if TYPE_CHECKING:
    from chameleon_elastic.runtime.world.abort import Sockets

__all__ = ["NCCL_NAMES", "CudaBackend"]


#: the names torch gives its NCCL implementations (2.14+ for the last two)
NCCL_NAMES = ("nccl", "nccl2", "nccl-legacy")


class CudaBackend(DeviceBackend):
    name = "cuda"

    def __init__(self, nccl: str = "nccl") -> None:
        if nccl not in NCCL_NAMES:
            raise PluginError(f"unknown NCCL implementation {nccl!r}; choose one of "
                              f"{', '.join(NCCL_NAMES)} (nccl: torch's default for the name).")
        self.nccl = nccl
        # nccl for tensors on the GPU, gloo for the runtime's small CPU tensors (the rows every
        # rank agrees on, votes): an nccl-only group refuses CPU tensors ("No backend type
        # associated with device type cpu", seen on an H200 by benchmarks/cuda_smoke.py)
        self.dist_backend = f"cpu:gloo,cuda:{nccl}"

    def is_available(self) -> bool:
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            return False
        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        import torch

        return int(torch.cuda.device_count())

    def device(self, local_rank: int = 0):
        import torch

        self._require()
        return torch.device("cuda", self._check_rank(local_rank))

    def memory_stats(self, local_rank: int = 0) -> MemoryStats:
        import torch

        dev = self.device(local_rank)
        return MemoryStats(
            device=str(dev),
            allocated=int(torch.cuda.memory_allocated(dev)),
            peak=int(torch.cuda.max_memory_allocated(dev)),
            reserved=int(torch.cuda.memory_reserved(dev)),
            total=int(torch.cuda.get_device_properties(dev).total_memory),
        )

    def synchronize(self, local_rank: int = 0) -> None:
        import torch

        torch.cuda.synchronize(self.device(local_rank))

    def unblock(self, sockets: Sockets) -> None:
        """NCCL can abort: ``ncclCommAbort`` on every communicator makes the blocked collective
        return (the sockets of the gloo side-groups, if any, are shut down as well)."""
        try:
            torch_compat.abort_process_group()
        except (ImportError, RuntimeError, ValueError):
            pass
        super().unblock(sockets)

    def abort_process_groups(self) -> None:
        """``ncclCommAbort`` on every communicator at once (torch's ``_abort_process_group``),
        so a collective blocked on a dead peer returns; then the groups are destroyed. Not yet
        exercised on a GPU by the suite (no GPU on CI)."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                torch_compat.abort_process_group()
            except (ImportError, RuntimeError, ValueError):
                pass
        super().abort_process_groups()
