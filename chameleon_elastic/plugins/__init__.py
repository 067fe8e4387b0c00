"""Device back-ends: cpu/gloo, cuda/nccl, npu/hccl (torch_npu, imported lazily).

``get_backend(name)`` is the one factory; ``name=None`` (or ``"auto"``) picks the first
available of npu, cuda, cpu. It also takes the names torch.distributed uses, compound ones
included (``dist.get_backend()`` says ``"cpu:gloo,cuda:nccl"`` for a cuda world), and the two
NCCL implementations of torch 2.14+: ``nccl-legacy`` (the classic ``ProcessGroupNCCL``) and
``nccl2``; plain ``nccl`` is whichever torch builds for that name (nccl2 from 2.15). Importing
this package imports neither torch nor torch_npu, so the launcher can call it lazily for device
memory without paying for a framework it may not need.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import DeviceBackend, MemoryStats, PluginError

__all__ = [
    "DeviceBackend",
    "MemoryStats",
    "PluginError",
    "backend_names",
    "device_backends",
    "get_backend",
    "memory_stats",
]


def _cpu() -> DeviceBackend:
    from .cpu import CpuBackend

    return CpuBackend()


def _cuda(nccl: str = "nccl") -> DeviceBackend:
    from .cuda import CudaBackend

    return CudaBackend(nccl)


def _npu() -> DeviceBackend:
    from .npu import NpuBackend

    return NpuBackend()


_FACTORIES: dict[str, Callable[[], DeviceBackend]] = {"cpu": _cpu, "cuda": _cuda, "npu": _npu}
_ALIASES = {"gloo": "cpu", "nccl": "cuda", "gpu": "cuda", "hccl": "npu", "ascend": "npu"}
_AUTO_ORDER = ("npu", "cuda", "cpu")


def device_backends(backend: str) -> dict[str, str]:
    """Device type -> torch.distributed backend name, for a backend string as
    ``init_process_group`` takes it: ``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda":
    "nccl"}``; a plain name serves the device it is made for (``"nccl2"`` -> ``{"cuda":
    "nccl2"}``, ``"hccl"`` -> ``{"npu": "hccl"}``, ``"gloo"`` -> ``{"cpu": "gloo"}``)."""
    name = backend.strip().lower()
    if ":" in name:
        pairs = (part.split(":", 1) for part in name.split(",") if ":" in part)
        return {device.strip(): named.strip() for device, named in pairs}
    device = "cuda" if name.startswith("nccl") else "npu" if name == "hccl" else "cpu"
    return {device: name}


def backend_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_backend(name: str | None = None) -> DeviceBackend:
    """The back-end called ``name`` (cpu, cuda, npu, or their dist names gloo, nccl, hccl,
    nccl2, nccl-legacy, or a compound dist name such as ``cpu:gloo,cuda:nccl``: its accelerator
    decides).

    ``None`` or ``"auto"`` returns the first available of npu, cuda, cpu. A known back-end is
    returned even if unavailable (``is_available()`` says so); an unknown name raises
    :class:`PluginError`.
    """
    if name is None or name.lower() == "auto":
        for candidate in _AUTO_ORDER:
            backend = _FACTORIES[candidate]()
            if backend.is_available():
                return backend
        return _cpu()  # pragma: no cover - cpu is always available
    if ":" in name:   # a compound dist name: the accelerator's part names the device
        devices = device_backends(name)
        accelerators = [d for d in devices if d != "cpu"]
        name = devices[accelerators[0]] if accelerators else devices.get("cpu", name)
    if name.lower().startswith("nccl"):   # which NCCL implementation: plugins/cuda.py
        return _cuda(name.lower())
    key = _ALIASES.get(name.lower(), name.lower())
    factory = _FACTORIES.get(key)
    if factory is None:
        raise PluginError(
            f"unknown device back-end {name!r}; choose one of: "
            f"{', '.join(_FACTORIES)} (or auto to pick the best available; for cuda, nccl2 or "
            "nccl-legacy to choose torch's NCCL implementation)."
        )
    return factory()


def memory_stats(name: str | None = None, local_rank: int = 0) -> MemoryStats:
    """Memory figures of ``local_rank``'s device on back-end ``name`` (default: auto)."""
    return get_backend(name).memory_stats(local_rank)
