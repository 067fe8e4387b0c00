"""The device back-end interface: what the runtime and the launcher need to know about a device.

A back-end names the torch.distributed backend that fits the device (gloo, nccl, hccl), maps a
local rank to a ``torch.device`` and reports memory figures. Each back-end lives in its own
module and imports its framework lazily, inside the methods, so that importing
``chameleon_elastic.plugins`` costs nothing and never fails on a machine without the device;
only asking an unavailable back-end for a device raises :class:`PluginError`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chameleon_elastic.runtime.world.abort import Sockets

__all__ = ["DeviceBackend", "MemoryStats", "PluginError"]


class PluginError(RuntimeError):
    """A device back-end that cannot be used here; the message names the back-end and the fix."""


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device in bytes.

    ``allocated`` is what tensors use now, ``peak`` the most they used since the last reset (or
    since the process started), ``reserved`` what the caching allocator (or, on CPU, the process)
    holds, and ``total`` the capacity of the device.
    """

    device: str
    allocated: int
    peak: int
    reserved: int
    total: int

    @property
    def free(self) -> int:
        return max(self.total - self.reserved, 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "allocated": self.allocated,
            "peak": self.peak,
            "reserved": self.reserved,
            "total": self.total,
            "free": self.free,
        }


class DeviceBackend(abc.ABC):
    """One kind of device: cpu, cuda or npu."""

    #: short name used by :func:`chameleon_elastic.plugins.get_backend`
    name: str = ""
    #: the torch.distributed backend for this device
    dist_backend: str = ""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when the framework is importable and at least one device is visible."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Visible devices of this kind on this host (0 when unavailable)."""

    @abc.abstractmethod
    def device(self, local_rank: int = 0) -> Any:
        """The ``torch.device`` a worker with this local rank should use."""

    @abc.abstractmethod
    def memory_stats(self, local_rank: int = 0) -> MemoryStats:
        """Memory figures of the device used by ``local_rank``."""

    def synchronize(self, local_rank: int = 0) -> None:
        """Wait for queued device work (needed before reading a clock; no-op on CPU)."""

    def through_host(self, dist_backend: str) -> bool:
        """Whether this device's tensors must be copied into host memory to be sent or received
        point to point by ``dist_backend``, the torch.distributed backend that serves this
        device type in the group (runtime/world/wire.py asks). Gloo's ``send`` and ``recv``
        give its TCP transport the tensor's own memory, which must be the host's (its
        collectives stage device tensors themselves); every other backend here (nccl, hccl)
        reads its device's memory. The CPU's tensors are in host memory already (cpu.py)."""
        return dist_backend == "gloo"

    def group_options(self, timeout_s: float) -> Any | None:
        """Backend options for the device part of a process group this process makes
        (``pg_options``; runtime/world/groups.py), None for torch's defaults. Gloo needs none;
        NCCL's make communicators that can be aborted safely (plugins/cuda.py)."""
        return None

    def unblock(self, sockets: Sockets) -> None:
        """Make a transfer blocked in the training thread fail now; called from another thread
        when the agents have moved on to a newer plan generation, and by a survivor tearing its
        groups down (runtime/world/abort.py). Never takes a group out of torch's books: the
        training thread may still be using it. Gloo has no abort, so its groups' connected
        sockets (``sockets``, recorded when the groups were formed) are shut down for reading:
        the blocked receive returns "Connection closed by peer" as if the peer had died."""
        from chameleon_elastic.runtime.world.abort import shut_down

        shut_down(sockets)

    def forget_groups(self) -> list[object]:
        """After ``unblock``, on the training thread, before the plan's groups are released:
        take out of torch's books, without shutting them down, the groups whose communicators
        were aborted, and return them for the caller to free. Gloo aborts nothing, so nothing:
        its groups are destroyed as before (their tables, then ``abort_process_groups``)."""
        return []

    def abort_process_groups(self) -> None:
        """Tear down every process group of this process after a peer was lost; never raises.

        Gloo cannot abort a collective; its groups' sockets were cut already (``unblock``), and
        a peer blocked on this process is cut by its own watchdog when the agents publish the
        next generation, which every survivor waits for anyway (runtime/world/abort.py). Back-ends
        whose collectives can block on a dead peer forever (NCCL) abort their communicators
        instead, and never shut an aborted one down (plugins/cuda.py)."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass

    def context_lost(self, message: str) -> bool:
        """Whether an error (its message: what a recovery keeps of it) says this process can
        never use its device again, so that it must be restarted rather than recover in place.
        Nothing on the CPU; on a GPU, a poisoned CUDA context (plugins/cuda.py)."""
        return False

    def _require(self) -> None:
        if not self.is_available():
            raise PluginError(
                f"device back-end {self.name!r} is not available on this host (no visible "
                f"device or its framework is not installed); use get_backend('cpu') or "
                f"get_backend(None) to pick the best available back-end."
            )

    def _check_rank(self, local_rank: int) -> int:
        count = self.device_count()
        if local_rank < 0 or (count and local_rank >= count):
            raise PluginError(
                f"local rank {local_rank} has no {self.name} device (this host has {count}); "
                f"start at most {count} workers per node (--nproc-per-node) or set the visible "
                f"devices accordingly."
            )
        return local_rank
