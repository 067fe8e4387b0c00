"""A world of real gloo processes on this machine, for tests, benchmarks and examples.

``run_local_world(fn, world_size, *args)`` starts ``world_size`` processes, joins them
into one gloo process group through a FileStore in a private temporary directory (no ports to
race for), calls ``fn(rank, world_size, *args)`` in each and returns the per-rank results in
rank order. Every wait has a deadline: if a rank raises, the others are killed and the rank's
traceback is re-raised here; if the deadline passes (a hang, a deadlock), every child is
killed and :class:`LocalWorldError` says which ranks had not finished. No child outlives the
call.

Processes come from a ``forkserver`` that imports torch and the runtime once (importing torch
takes seconds per process on a loaded machine); each world then forks from it, clean of the
caller's threads and state, so successive worlds start in a fraction of a second.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import PipelineRuntimeError

__all__ = ["PRELOAD", "LocalWorldError", "run_local_world"]

# torch._decomp, _dynamo, fake tensors: sizing a stage boundary (executor.boundary_spec) imports
# them, which costs seconds per process; importing them once in the forkserver makes it free.
PRELOAD = ("torch", "torch.distributed", "torch._decomp", "torch._dynamo",
           "torch._subclasses.fake_tensor",
           "chameleon_elastic.runtime", "chameleon_elastic.planning.schedule",
           "chameleon_elastic.planning.restorer", "chameleon_elastic.planning.allreduce")


class LocalWorldError(PipelineRuntimeError):
    """A local world failed: a rank raised, died or missed the deadline."""


def _child(rank: int, world_size: int, store_path: str, timeout_s: float, fn: Callable,
           args: tuple, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        # gloo's connect can return on one rank before its peer has read the handshake: a rank
        # whose fn ends at once would then close the pair under a peer still connecting, and
        # the peer's error would hide the real one. The barrier holds until every pair is up.
        dist.barrier()
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure, even KeyboardInterrupt, goes to the parent
        results.put((rank, False, traceback.format_exc()))


def run_local_world(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout_s: float = 60.0, collective_timeout_s: float = 30.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank.

    ``fn`` and ``args`` must be picklable (module-level functions, plain data).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="chameleon-world-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(r, world_size, store_path, collective_timeout_s, fn, args,
                                   results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise LocalWorldError(
                        f"local world of {world_size} ranks missed its {timeout_s:.0f} s "
                        f"deadline; ranks {missing} had not finished (hang or deadlock)."
                    )
                try:
                    rank, ok, value = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in out and p.exitcode not in (None, 0)]
                    if dead:
                        raise LocalWorldError(
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                            "before reporting a result."
                        ) from None
                    continue
                if not ok:
                    raise LocalWorldError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5 if len(out) == world_size else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            results.close()
        return [out[r] for r in range(world_size)]
