"""Device back-ends: cpu/gloo, cuda/nccl, npu/hccl (torch_npu, imported lazily).

``get_backend(name)`` is the one factory; ``name=None`` (or ``"auto"``) picks the first
available of npu, cuda, cpu. Importing this package imports neither torch nor torch_npu, so the
launcher can call it lazily for device memory without paying for a framework it may not need.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import DeviceBackend, MemoryStats, PluginError

__all__ = [
    "DeviceBackend",
    "MemoryStats",
    "PluginError",
    "backend_names",
    "get_backend",
    "memory_stats",
]


def _cpu() -> DeviceBackend:
    from .cpu import CpuBackend

    return CpuBackend()


def _cuda() -> DeviceBackend:
    from .cuda import CudaBackend

    return CudaBackend()


def _npu() -> DeviceBackend:
    from .npu import NpuBackend

    return NpuBackend()


_FACTORIES: dict[str, Callable[[], DeviceBackend]] = {"cpu": _cpu, "cuda": _cuda, "npu": _npu}
_ALIASES = {"gloo": "cpu", "nccl": "cuda", "gpu": "cuda", "hccl": "npu", "ascend": "npu"}
_AUTO_ORDER = ("npu", "cuda", "cpu")


def backend_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_backend(name: str | None = None) -> DeviceBackend:
    """The back-end called ``name`` (cpu, cuda, npu, or their dist names gloo, nccl, hccl).

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
    key = _ALIASES.get(name.lower(), name.lower())
    factory = _FACTORIES.get(key)
    if factory is None:
        raise PluginError(
            f"unknown device back-end {name!r}; choose one of: "
            f"{', '.join(_FACTORIES)} (or auto to pick the best available)."
        )
    return factory()


def memory_stats(name: str | None = None, local_rank: int = 0) -> MemoryStats:
    """Memory figures of ``local_rank``'s device on back-end ``name`` (default: auto)."""
    return get_backend(name).memory_stats(local_rank)
