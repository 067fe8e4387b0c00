"""Our subclasses of torch.distributed.checkpoint's (DCP's) planner, writer and stager.

A module of its own, imported only where a checkpoint is written or read: importing DCP costs
about a second per process (it pulls in DTensor, sympy and torch.export), which every agent and
worker used to pay at start-up, checkpoints or not. Nothing else in the package imports DCP at
module level.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["OnTheCPU", "SafeLoadPlanner", "Yielding"]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but plain values come back through ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if not self.flatten_state_dict:
            self.state_dict[read_item.dest_index.fqn] = loaded
            return
        *parents, last = self.mappings[read_item.dest_index.fqn]
        node = self.original_state_dict
        for part in parents:
            node = node[part]
        node[last] = loaded


class Yielding(FileSystemWriter):
    """DCP's file writer, whose thread yields the CPU to training: the background save runs at
    the lowest priority (on Linux a thread has its own nice value), so it takes the cores the
    training thread leaves idle rather than slowing its steps."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # the first call DCP makes in its background thread
        with contextlib.suppress(AttributeError, OSError):   # not Linux: the default priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


class OnTheCPU(AsyncStager):
    """The state is already a detached copy: staging only moves accelerator tensors to the
    CPU (the default stager would copy every tensor once more)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        def cpu(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: cpu(v) for k, v in value.items()}
            return value.cpu() if isinstance(value, torch.Tensor) else value
        return cpu(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
