"""Point-to-point transfers of device tensors, through host memory where the group's backend
cannot read the device's memory.

Why: gloo's ``send`` and ``recv`` hand the tensor's own memory to its TCP transport, whatever
the device (torch's ProcessGroupGloo.cpp, ``ProcessGroupGloo::send`` / ``recv``:
``context->createUnboundBuffer(tensor.data_ptr(), nbytes)``, no device dispatch; 2.15's shipped
ProcessGroupGloo.hpp: a ``SendWork`` holds the tensor and the buffer, no host copy, no event;
torch's backend table: gloo, GPU, send and recv "✘"). A CUDA tensor's memory is not the host's,
so its transfer fails ("Bad address" from the socket call, read in that source, not yet seen on
a GPU here) and takes the pair's socket down with it: the runtime would take that for a lost
peer. Gloo's collectives are another matter: all-reduce, broadcast, all-gather, gather, scatter,
all-to-all and reduce each copy a CUDA tensor into pinned host memory and back themselves
(their ``Async...CUDAWork`` classes; all-reduce in gloo/ProcessGroupGlooCuda.cpp from 2.8), so
the gradient sums need nothing from us.

Where that matters: processes training on GPUs over a gloo world, e.g. several processes on one
GPU (NCCL refuses two ranks on one GPU; benchmarks/cuda_smoke.py ``--procs``). Every send and
receive of a device tensor then goes through a host copy: a stage boundary's activations and
gradients (execution/executor.py), a layer moved to a peer (state/migrate.py, the snapshots'
restore) and the job's state handed to a process that joined (state/user_state.py).

One home for the decision: the device plugin says whether its tensors need the host for the
backend that serves its device type in the group (``DeviceBackend.through_host``); this module
asks it, once per (backend, device type), and every transfer of the runtime goes through
:func:`isend` and :func:`recv`, whose signatures are torch's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from chameleon_elastic.plugins import PluginError, device_backends, get_backend

__all__ = ["isend", "recv", "serving_backend", "through_host"]


def serving_backend(backend: str, device_type: str) -> str | None:
    """The torch.distributed backend that serves ``device_type`` in a group made on
    ``backend`` (as ``dist.get_backend`` says it): its part of a compound name
    (``cpu:gloo,cuda:nccl`` -> ``nccl`` for cuda), the name itself otherwise (torch registers a
    plain ``gloo`` for cpu and cuda alike); None when a compound name has no part for it."""
    if ":" in backend:
        return device_backends(backend).get(device_type)
    return backend.strip().lower()


@functools.lru_cache(maxsize=64)
def _needs_host(backend: str, device_type: str) -> bool:
    if device_type == "cpu":
        return False
    served = serving_backend(backend, device_type)
    try:
        plugin = get_backend(device_type)
    except PluginError:   # a device no plugin knows: torch says what it makes of it
        return False
    return served is not None and plugin.through_host(served)


def through_host(device: torch.device, group: Any = None) -> bool:
    """Whether a tensor on ``device`` must go through host memory to be sent or received on
    ``group`` (None: the world)."""
    return _needs_host(str(dist.get_backend(group)), device.type)


def isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
          **kwargs: Any) -> Any:
    """``dist.isend``; a device tensor that must go through the host is copied there first
    (a blocking copy: the bytes are in place when the send is posted). The work keeps the
    tensor it sends alive until it completes (gloo's ``SendWork`` holds it)."""
    if through_host(tensor.device, group):
        tensor = tensor.to("cpu")
    return dist.isend(tensor, dst=dst, group=group, tag=tag, **kwargs)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
         **kwargs: Any) -> Any:
    """``dist.recv`` into ``tensor``; for a device tensor that must go through the host, into a
    host buffer of its shape first, then copied onto the device."""
    if not through_host(tensor.device, group):
        return dist.recv(tensor, src=src, group=group, tag=tag, **kwargs)
    host = torch.empty_like(tensor, device="cpu")
    source = dist.recv(host, src=src, group=group, tag=tag, **kwargs)
    tensor.copy_(host)
    return source
