"""Random streams that do not depend on the plan: one per (seed, step, micro-batch, layer).

Dropout and any other random operation inside a layer draw from torch's generator. Left
global, that generator's state would depend on what the process ran before (which layers, how
many micro-batches, in which order), so a model with dropout would train differently under
every plan and change its masks at every re-plan. Instead, each layer's forward for one global
micro-batch of one step runs on a generator seeded from ``(model seed, step, global
micro-batch, layer)`` alone, whichever device runs it, and the process's own stream is put
back afterwards. A recomputing stage re-enters the same seeding before each layer, so the
recomputed forward draws the very same masks. Single-process training does the same
(:func:`chameleon_elastic.models.toy.reference_run`) and gets the same result.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

__all__ = ["layer_seed", "layer_seeder", "own_streams"]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def layer_seed(seed: int, step: int, micro_batch: int, layer: int) -> int:
    """A 63-bit seed, a pure function of its arguments."""
    return _last_mix(_micro_batch_key(seed, step, micro_batch), layer)


def _micro_batch_key(seed: int, step: int, micro_batch: int) -> int:
    """What the seeds of one micro-batch's layers share."""
    x = _mix(seed & _MASK)
    for part in (step, micro_batch):
        x = _mix(x ^ (part & _MASK))
    return x


def _last_mix(key: int, layer: int) -> int:
    return _mix(key ^ (layer & _MASK)) >> 1


def _accelerator(device: torch.device) -> tuple[object, int] | None:
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device.type)
    return module, device.index if device.index is not None else module.current_device()


@contextlib.contextmanager
def own_streams(device: torch.device) -> Iterator[None]:
    """Put the process's generators (the CPU's and ``device``'s) back as they were after the
    body, which reseeds them per layer (:func:`layer_seeder`)."""
    accelerator = _accelerator(device)
    cpu = torch.random.default_generator.get_state()
    saved = accelerator[0].get_rng_state(accelerator[1]) if accelerator else None
    try:
        yield
    finally:
        torch.random.default_generator.set_state(cpu)
        if accelerator:
            accelerator[0].set_rng_state(saved, accelerator[1])


def layer_seeder(seed: int, step: int, micro_batch: int,
                 device: torch.device) -> Callable[[int], None]:
    """``seed(layer)``: seed the CPU generator and ``device``'s with :func:`layer_seed` for
    that layer of this micro-batch (inside :func:`own_streams`). The seeds' shared part and
    the device's generator are found once per micro-batch: per layer they had cost 17 us,
    0.55 ms of the tiny GPT's step."""
    return functools.partial(_seed, _micro_batch_key(seed, step, micro_batch),
                             _accelerator(device))


def _seed(key: int, accelerator: tuple[object, int] | None, layer: int) -> None:
    value = _last_mix(key, layer)
    torch.random.default_generator.manual_seed(value)
    if accelerator:
        with accelerator[0].device(accelerator[1]):
            accelerator[0].manual_seed(value)
