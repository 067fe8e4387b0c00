"""CUDA back-end: nccl (plus gloo for CPU tensors), one GPU per local rank, figures from
torch's caching allocator, and the way a survivor leaves a world that lost a peer.

Which NCCL: torch 2.15 builds its new nccl2 backend (``ProcessGroupNCCL2``, on the torchcomms
engine) for the name ``nccl``, 2.14 builds it for ``nccl2`` only, and both keep the classic
``ProcessGroupNCCL`` as ``nccl-legacy``. The back-end is made with one of those names
(``get_backend("nccl-legacy")``, or ``CHAMELEON_BACKEND=nccl-legacy`` for a job's workers);
``nccl``, the default, is whichever torch builds for it. How groups are then made on each
(device binding, ``new_group`` or ``split_group``) is decided in runtime/world/groups.py.

Leaving a broken world (docs/runtime.md, *NCCL: leaving a collective blocked on a lost peer*).
A collective blocked on a dead or frozen peer does not return by itself on NCCL (a dead peer
behind NVLink or shared memory is not even noticed), and the way out is ``ncclCommAbort``,
under rules this module keeps:

- every communicator of the process is aborted, all at once (``torch_compat.
  abort_communicators``: one NCCL group call, as torch's ``_abort_process_group``), since
  communicators aborted one by one can deadlock each other; and each only once, by whichever
  thread comes first: the watchdog's (runtime/world/abort.py, when the agents publish a newer
  generation) or the training thread's, tearing its groups down after the loss;
- the watchdog's abort leaves the groups in torch's books (the training thread may still be
  using them); the training thread takes them out (:meth:`CudaBackend.forget_groups`) without
  shutting them down: never a ``destroy_process_group`` after an abort;
- communicators are made non-blocking (:meth:`CudaBackend.group_options`): NCCL's abort is
  safe only while no thread waits inside an NCCL call, and in that mode none does (a call
  returns ``ncclInProgress`` and torch polls);
- NCCL's own watchdog must not tear the survivor down first: a job's workers run with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (launcher/workers/worker_env.py);
- a process whose CUDA context is poisoned (a device-side assert, an illegal address) cannot
  use its GPU again: :meth:`CudaBackend.context_lost` says so, and the worker exits to be
  restarted alone while its peers recover in place (runtime/recovery/in_place.py).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from chameleon_elastic import torch_compat

from .base import DeviceBackend, MemoryStats, PluginError

if TYPE_CHECKING:
    from chameleon_elastic.runtime.world.abort import Sockets

__all__ = ["NCCL_NAMES", "NONBLOCKING_FROM", "STICKY_ERRORS", "CudaBackend", "abort_once"]

log = logging.getLogger("chameleon_elastic.plugins.cuda")


#: the names torch gives its NCCL implementations (2.14+ for the last two)
NCCL_NAMES = ("nccl", "nccl2", "nccl-legacy")

#: the first NCCL whose non-blocking communicators are used: 2.26 hangs in that mode
#: (pytorch#153960: torch stopped choosing it by itself for eager groups), and 2.25.1's abort is
#: broken (torchft requires 2.25 and warns about it)
NONBLOCKING_FROM = (2, 27)

#: CUDA's sticky errors, as ``cudaGetErrorString`` says them: after one, every CUDA call of the
#: process fails, and only a new process can use the GPU again
STICKY_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "hardware stack error",
    "invalid program counter",
    "uncorrectable ECC error encountered",
)

#: the process groups whose communicators this process has aborted: an abort is once per
#: communicator, and the watchdog's thread and the training thread both come to abort them
_ABORTED: weakref.WeakSet = weakref.WeakSet()
_ABORTING = threading.Lock()


def abort_once(groups: list[Any]) -> None:
    """Abort, all at once, the NCCL communicators of those of ``groups`` that no thread of this
    process has aborted yet; the groups stay in torch's books. Never raises: a failed abort is
    logged (the recovery's deadlines bound what follows)."""
    with _ABORTING:
        fresh = [g for g in groups if g not in _ABORTED and torch_compat.has_nccl(g)]
        failed = torch_compat.abort_communicators(fresh)
        _ABORTED.update(fresh)
    for line in failed:
        log.warning("aborting an NCCL communicator failed: %s", line)


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

    def group_options(self, timeout_s: float) -> Any | None:
        """The NCCL part's options: non-blocking communicators (``config.blocking = 0``), in
        which NCCL's abort is safe, from NCCL 2.27 (:data:`NONBLOCKING_FROM`) and unless the
        user chose with ``TORCH_NCCL_USE_COMM_NONBLOCKING`` (kept: torch reads it when the
        options leave the choice open). A non-blocking call that waits (a split, an abort) is
        bounded by the collective timeout: nccl2 waits the group's timeout, the classic backend
        ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (30 min unless set; set here, unless the user did,
        before the first group, since torch reads it once). None on a torch without NCCL."""
        user = os.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING")
        nonblocking = user is None and self._nccl_version() >= NONBLOCKING_FROM
        if nonblocking:
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, round(timeout_s))))
        return torch_compat.nccl_options(nonblocking)

    def _nccl_version(self) -> tuple[int, ...]:
        try:
            import torch

            return tuple(torch.cuda.nccl.version())
        except (AttributeError, RuntimeError, TypeError):   # a torch built without NCCL
            return (0,)

    def unblock(self, sockets: Sockets) -> None:
        """NCCL can abort: every communicator of this process at once, once (:func:`abort_once`),
        makes a collective blocked on a lost peer return, and the training thread's next NCCL
        call fail; the groups stay in torch's books. The sockets of the gloo part (the
        world's CPU side, checkpoint and snapshot groups) are shut down as on the CPU."""
        abort_once(torch_compat.process_groups())
        super().unblock(sockets)

    def forget_groups(self) -> list[object]:
        """Abort what no thread has aborted yet (every communicator, at once), then take every
        group out of torch's books without shutting any down (``torch_compat.
        forget_process_groups``) and return them: after an abort a shutdown can hang, so the
        plan's tables and the snapshot's group find them gone and destroy nothing."""
        abort_once(torch_compat.process_groups())
        return torch_compat.forget_process_groups()

    def abort_process_groups(self) -> None:
        """``ncclCommAbort`` on every communicator at once, then every group out of torch's
        books, none shut down (:meth:`forget_groups`); after it no group is left. Not exercised
        on a GPU by the suite (no GPU on CI): tests/runtime/test_nccl_path.py checks the order
        of the calls on a labelled fake, benchmarks/cuda_smoke.py on a GPU."""
        self.forget_groups()

    def context_lost(self, message: str) -> bool:
        """Whether ``message`` carries one of CUDA's sticky errors (:data:`STICKY_ERRORS`): a
        device-side assert, an illegal address, ... poison the process's CUDA context, so it
        can neither abort its communicators cleanly nor train on; it must be restarted."""
        return any(error in message for error in STICKY_ERRORS)
