"""Step times for ``chameleon-run --profile-out``, written by every device.

``record_step(seconds)`` appends one JSON line to ``$CHAMELEON_PROFILE_DIR/device-<d>.jsonl``;
the agent reads those files and writes the measured profile (launcher/observation/profiler.py). It lives
in the runtime so that a training process records without importing the launcher, and
``PipelineTrainer.run`` calls it on every working device after each committed step: every
device's time reaches the profile, not only the reporting process's. Without
``CHAMELEON_PROFILE_DIR`` it does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["PROFILE_DIR_VAR", "record_step"]

PROFILE_DIR_VAR = "CHAMELEON_PROFILE_DIR"


def record_step(seconds: float, device_memory_peak_bytes: int | None = None) -> None:
    """One step of ``seconds`` on this device; cheap, and a no-op outside chameleon-run
    ``--profile-out``. ``device_memory_peak_bytes``: the device's peak so far, if known (only
    the worker's own process can see its device allocations)."""
    directory = os.environ.get(PROFILE_DIR_VAR)
    if not directory:
        return
    device = os.environ.get("CHAMELEON_DEVICE", os.environ.get("RANK", "0"))
    record: dict[str, object] = {"ts": time.time(), "step_s": float(seconds),
                                 "generation": os.environ.get("CHAMELEON_PLAN_GENERATION")}
    if device_memory_peak_bytes is not None:
        record["device_memory_peak_bytes"] = int(device_memory_peak_bytes)
    with open(Path(directory) / f"device-{device}.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
