"""This device's micro-batches, read ahead in the background.

Only the devices that touch data read it: a first stage its micro-batches' inputs, a last stage
their targets (a device that is both reads each micro-batch once). Which samples a micro-batch
holds is a pure function of (step, plan) and of (seed, epoch) (:mod:`.data`), so the next
step's micro-batches are known before the step starts: as step ``t``'s computation ends and
the training thread waits for its gradient sums, :meth:`Feed.read_ahead` asks for step
``t + 2``'s, which background readers fetch while it waits and while step ``t + 1`` computes
(:meth:`Feed.begin` asks for step ``t``'s and ``t + 1``'s itself where nothing has: the first
step, a new plan).

Readers are threads of this process (``workers`` of them, at least one), or with
``processes=True`` as many worker processes (spawned once per trainer; the dataset must be
picklable, and is sent once per process). Reading in threads suits datasets that wait (files,
network, sleeps); Python-heavy decoding holds the GIL and is better in processes. On cuda the
readers pin the micro-batch's memory, and the training thread copies it to the device without
blocking.

What was read ahead belongs to one plan: when a step begins under another plan (a recovery, a
re-plan), everything read for the abandoned one is dropped, because the new plan may give this
device other micro-batches. The data position is the committed step, nothing more.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import torch

from chameleon_elastic.plan import ExecutionPlan

from ..data import sample_ids
from ..errors import PipelineRuntimeError
from ..model import PipelineModel, collate_samples, sample_indices
from ..tensors import leaf_map

__all__ = ["Feed"]

Batch = tuple[Any, Any]

_SOURCE: Any = None   # in a reader process only: the data it serves (sent once, at its start)


def _install(source: Any) -> None:
    global _SOURCE
    _SOURCE = source


def _read_in_process(indices: Sequence[int]) -> Batch:
    return collate_samples(_SOURCE, indices)


def _pinned(batch: Batch) -> Batch:
    return leaf_map(lambda t: t.pin_memory(), batch)


class Feed:
    """The micro-batches of one device (see the module's docstring). ``prefetch=False`` reads
    each micro-batch when the step needs it, in the training thread (the baseline)."""

    def __init__(self, model: PipelineModel, micro_batch_size: int,
                 torch_device: torch.device | None = None, *, prefetch: bool = True,
                 workers: int = 1, processes: bool = False) -> None:
        if workers < 1:
            raise PipelineRuntimeError(
                f"data_workers = {workers}; pass at least one background reader.")
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.torch_device = torch_device or torch.device("cpu")
        self.prefetch = prefetch
        self.workers = workers
        self.processes = processes
        self.pin = self.torch_device.type == "cuda"
        self.waited_s = 0.0     # time the training thread spent waiting for data
        self._pool: Executor | None = None
        self._plan: ExecutionPlan | None = None
        self._ahead: dict[tuple[int, int, int], Future] = {}
        self._wanted: tuple[tuple[int, int], ...] = ()

    @property
    def source(self) -> Any:
        return self.model.dataset if self.model.dataset is not None else self.model.sample

    def indices(self, plan: ExecutionPlan, step: int, pipeline: int,
                micro_batch: int) -> list[int]:
        """The dataset indices of local ``micro_batch`` of ``pipeline`` at ``step``."""
        positions = sample_ids(step, plan, pipeline, micro_batch, self.micro_batch_size)
        return sample_indices(self.model, positions,
                              plan.global_micro_batches * self.micro_batch_size)

    def begin(self, plan: ExecutionPlan, step: int,
              wanted: Sequence[tuple[int, int]]) -> None:
        """Step ``step`` starts under ``plan`` and will read the micro-batches ``wanted``
        (``(pipeline, micro-batch)`` pairs): drop what was read for another plan or an
        earlier step, and ask for this step's and the next one's, unless asked for already
        (:meth:`read_ahead` normally has)."""
        if plan is not self._plan:
            self.discard()
            self._plan = plan
        self._wanted = tuple(wanted)
        for key in [k for k in self._ahead if k[0] < step]:
            self._ahead.pop(key).cancel()
        self._request(step)
        self._request(step + 1)

    def read_ahead(self, step: int) -> None:
        """Ask for ``step``'s micro-batches (those of the plan and ``wanted`` of the last
        :meth:`begin`). The trainer calls it as a step's computation ends and the training
        thread is about to wait for its gradient sums, with the step after next: the
        readers then collate while it waits, not while it computes, and the next step's
        :meth:`begin` has nothing left to ask for (asking there, among the forwards, had
        cost the tiny GPT's step 0.7 ms, and its readers' work competed with the forwards)."""
        if self._plan is not None:
            self._request(step)

    def _request(self, step: int) -> None:
        if not self.prefetch:
            return
        for pipeline, micro_batch in self._wanted:
            if (step, pipeline, micro_batch) not in self._ahead:
                self._ahead[step, pipeline, micro_batch] = self._submit(
                    self._plan, step, pipeline, micro_batch)

    def batch(self, plan: ExecutionPlan, step: int, pipeline: int, micro_batch: int) -> Batch:
        """``(inputs, targets)`` of the micro-batch, on the training device."""
        began = time.perf_counter()
        future = self._ahead.pop((step, pipeline, micro_batch), None) \
            if plan is self._plan else None
        if future is not None:
            inputs, targets = future.result()
        else:
            inputs, targets = collate_samples(
                self.source, self.indices(plan, step, pipeline, micro_batch))
        move = lambda t: t.to(self.torch_device, non_blocking=self.pin)
        batch = leaf_map(move, inputs), leaf_map(move, targets)
        self.waited_s += time.perf_counter() - began
        return batch

    def discard(self) -> None:
        """Drop everything read ahead (a plan is abandoned)."""
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()
        self._plan = None

    def close(self) -> None:
        self.discard()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _submit(self, plan: ExecutionPlan, step: int, pipeline: int,
                micro_batch: int) -> Future:
        if self._pool is None:
            if self.processes:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_install, initargs=(self.source,))
            else:
                self._pool = ThreadPoolExecutor(self.workers,
                                                thread_name_prefix="chameleon-data")
        if not self.processes:   # a thread finds the indices too
            return self._pool.submit(self._read, plan, step, pipeline, micro_batch)
        future = self._pool.submit(_read_in_process,
                                   self.indices(plan, step, pipeline, micro_batch))
        if not self.pin:
            return future
        pinned: Future = Future()
        future.add_done_callback(lambda f: _settle(pinned, f))
        return pinned

    def _read(self, plan: ExecutionPlan, step: int, pipeline: int, micro_batch: int) -> Batch:
        batch = collate_samples(self.source, self.indices(plan, step, pipeline, micro_batch))
        return _pinned(batch) if self.pin else batch


def _settle(out: Future, done: Future) -> None:
    """Pin what a reader process sent (pinning needs this process's cuda context)."""
    try:
        out.set_result(_pinned(done.result()))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the batch
        out.set_exception(exc)
