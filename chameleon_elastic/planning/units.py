"""The unit view: a tensor-parallel job seen as the planner's devices.

With ``training.tp = t`` a stage does not run on one card but on a *unit* of ``t`` cards of
one node that hold its layers sharded (Megatron-style tensor parallelism). The planner, the
estimator, the plan cache and the simulator know nothing of shards: they plan devices. Rather
than teach each of them, ``unit_spec`` rewrites the job once into an equivalent job whose
devices *are* the units, and everything downstream runs on that view unchanged. Plans made on
it name units (``spec.unit_of`` / ``spec.cards_of`` map to cards and back).

What changes, and why (the job file's ``[model]`` figures are those of the whole, unsharded
layer on one card; ``cluster.devices`` counts cards):

- devices: ``cluster.devices / t`` units.
- failures: a unit fails when any of its cards does, so ``failure_rate_per_hour * t`` per
  unit (for independent per-card failures at rate r the first of t comes at rate t r).
- memory: ``device_memory_bytes`` stays per card, and every per-layer byte figure becomes what
  one card of the unit holds. ``param_bytes``, ``optimizer_bytes`` (hence gradients and the
  autocast copy) are divided by t: each card keeps a 1/t shard. ``activation_bytes`` are
  divided by t too. That is exact for tensor + sequence parallelism (Korthikanti et al. 2022:
  ``34 s b h / t`` per layer with flash attention) and an underestimate without sequence
  parallelism, where layer norms, dropout masks and residuals (about 10 of the 34) stay
  replicated. ``boundary_bytes`` (a stage's input and output) are *not* divided: every card of
  a unit holds the whole stage input. An absent ``boundary_bytes`` is resolved first from the
  unsharded activations, so the fallback keeps meaning "the whole layer's".
- transfers and the data-parallel all-reduce: card i of a unit talks to card i of the others,
  each card over its own link at ``bandwidth_bytes_per_s``, so a unit moves 1/t of the bytes
  per card in parallel; dividing the byte figures by t is exactly that (the estimator's
  ``transfer_time`` and ``ring_time`` then need no change).
- time: a layer computes ``t * tp_efficiency`` times faster than on one card, plus the unit's
  own all-reduce of the layer's output in each direction (forward: the output; backward: its
  gradient, the same size): a ring over t cards at ``cluster.tp_bandwidth``,
  ``2 (t - 1) / t * bytes / bandwidth``, with ``bytes`` the layer's ``boundary_figures``
  converted to the training precision as the estimator converts activations. Megatron has two
  such all-reduces per layer per direction (after attention and after the MLP) and small
  GEMMs lose efficiency; we price one all-reduce and let ``tp_efficiency`` absorb the rest.
- the view's ``training.tp`` is 1 (its devices are already units) and its ``tp_efficiency``
  1.0 (already folded into the times), so ``unit_spec(unit_spec(s)) == unit_spec(s)``.

For ``tp = 1`` the view is the spec itself: nothing changes for jobs without tensor
parallelism, not even the object the planner memoises on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from ..spec import ELEMENT_BYTES, JobSpec, ModelProfile
from .estimator import ring_seconds

__all__ = ["tp_allreduce_s", "unit_spec", "whole_layer_times"]


def unit_spec(spec: JobSpec) -> JobSpec:
    """The job as the planner sees it: one device per tensor-parallel unit (module docstring).

    ``tp = 1``: ``spec`` itself, the very object (a memo would hand back an earlier equal
    spec instead). Otherwise pure and memoised on the (hashable) spec: the CLIs, the
    simulator's policies and the launcher may ask for it at every event, and the planner's own
    memos key on the returned object, so equal specs give the same view object.
    """
    return spec if spec.training.tp == 1 else _unit_spec(spec)


@lru_cache(maxsize=64)
def _unit_spec(spec: JobSpec) -> JobSpec:
    tp = spec.training.tp
    cluster = spec.cluster
    return replace(
        spec,
        model=_unit_model(spec),
        cluster=replace(cluster, devices=cluster.devices // tp,
                        failure_rate_per_hour=cluster.failure_rate_per_hour * tp,
                        devices_per_node=(None if cluster.devices_per_node is None
                                          else cluster.devices_per_node // tp)),
        training=replace(spec.training, tp=1, tp_efficiency=1.0),
    )


def whole_layer_times(spec: JobSpec, unit_times: Sequence[float]) -> tuple[float, ...]:
    """Per-layer times measured on a unit (``--profile-out`` of a tensor-parallel job) as the
    job file states them: the whole layer on one card, the inverse of the unit view's timing
    (less the unit's all-reduce, times ``tp x tp_efficiency``). Where the measured time is less
    than the modelled all-reduce, a tenth of it is kept as compute: the figure must stay
    positive, and the link was evidently faster than modelled."""
    tp = spec.training.tp
    if tp == 1:
        return tuple(unit_times)
    speed = tp * spec.training.tp_efficiency
    return tuple(max(t - tp_allreduce_s(spec, layer), 0.1 * t) * speed
                 for layer, t in enumerate(unit_times))


def tp_allreduce_s(spec: JobSpec, layer: int) -> float:
    """One ring all-reduce of ``layer``'s output for one micro-batch over the unit's cards:
    ``2 (t - 1) / t * bytes / cluster.tp_bandwidth``, ``bytes`` the layer's boundary figure
    at the training precision; 0 for ``t = 1``. Paid once per layer in the forward and once
    in the backward (the output's gradient has the output's size)."""
    model = spec.model
    scale = ELEMENT_BYTES[spec.training.precision] / ELEMENT_BYTES[model.precision]
    return ring_seconds(model.boundary_figures[layer] * scale, spec.training.tp,
                        spec.cluster.tp_bandwidth)


def _unit_model(spec: JobSpec) -> ModelProfile:
    """Per-layer figures of one card of a unit: sharded bytes, sped-up compute plus the
    unit's all-reduce, whole boundaries (module docstring)."""
    model, tp = spec.model, spec.training.tp
    speed = tp * spec.training.tp_efficiency
    sync = [tp_allreduce_s(spec, layer) for layer in range(model.layers)]

    def shard(figures: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x / tp for x in figures)

    def timed(figures: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(t / speed + s for t, s in zip(figures, sync))

    return replace(
        model,
        forward_s=timed(model.forward_s),
        backward_s=timed(model.backward_s),
        param_bytes=shard(model.param_bytes),
        optimizer_bytes=shard(model.optimizer_bytes),
        activation_bytes=shard(model.activation_bytes),
        boundary_bytes=model.boundary_figures,
    )
