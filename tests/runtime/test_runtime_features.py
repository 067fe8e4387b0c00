"""What real training brings, under symmetric, asymmetric and rerouted plans, equals single
process training done with torch's own tools.

One live world of 7 gloo processes trains every feature under each of the three plan kinds in
turn (new process groups per plan, as in-place recovery builds them):

- ``clip``: global gradient-norm clipping (``max_grad_norm``) against ``clip_grad_norm_`` over
  the whole model: each layer counted once, however many replicas it has;
- ``ties``: the first and last layers share a weight (one ``nn.Parameter`` in the reference);
- ``schedule``: warm-up + cosine (torch's chainable ``SequentialLR``) with AdamW;
- ``structured``: stages pass (hidden, mask, integer counter) as tuples and dicts;
- ``recompute``: every stage recomputes its activations;
- ``all``: all of the above at once;
- ``groups``: AdamW parameter groups chosen by the parameters' names (no weight decay on
  biases; ``make_optimizer`` gets ``(name, parameter)`` pairs), with a tie, a schedule and
  clipping;
- ``dropout``, ``dropout_recompute``: dropout p = 0.1 after every hidden layer; the second with
  every stage recomputing, which must replay the very masks of the first forward;
- ``bf16`` / ``fp16``: autocast over fp32 master weights (fp16 with loss scaling, against torch's
  ``GradScaler``), on the ``all`` model in float32.

float64 cases must match at rtol 1e-9 (only the order of sums differs). Low precision rounds
every matmul's inputs to 8 (bf16) or 11 (fp16) significant bits. The runtime and the reference
run the same operations on the same values per micro-batch, so step 0 (same weights
everywhere) differs only by fp32 sums taken in another order: rtol 1e-6, while computing it in
fp32 instead moves it by 6e-4 (bf16) and 1e-5 (fp16). From step 1 on, those tiny differences
in the weights flip some roundings to bf16/fp16 and AdamW amplifies them: measured up to
3.2e-4 by step 4, so later steps are held to rtol 2e-3, half of bf16's resolution (2^-8).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from chameleon_elastic.models.toy import (
    StepCounter,
    WeightEMA,
    featured_model,
    mlp_model,
    reference_run,
)
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import PipelineTrainer, save_checkpoint
from chameleon_elastic.runtime.precision import LossScale
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

STEPS = 5
MBS = 2
CLIP = 0.08

CONFIGS = {  # name -> (model kwargs, trainer kwargs, recompute every stage)
    "clip": ({"kind": "mlp"}, {"max_grad_norm": CLIP}, False),
    "ties": ({"schedule": False, "structured": False}, {}, False),
    "schedule": ({"tie": False, "structured": False}, {}, False),
    "structured": ({"tie": False, "schedule": False}, {}, False),
    "recompute": ({"kind": "mlp"}, {}, True),
    "all": ({}, {"max_grad_norm": CLIP}, True),
    "groups": ({"groups": True}, {"max_grad_norm": CLIP}, False),
    "dropout": ({"dropout": 0.1}, {}, False),
    "dropout_recompute": ({"dropout": 0.1, "tie": False}, {"max_grad_norm": CLIP}, True),
    "bf16": ({"dtype": "float32"}, {"max_grad_norm": CLIP, "precision": "bf16"}, True),
    "fp16": ({"dtype": "float32"}, {"max_grad_norm": CLIP, "precision": "fp16"}, False),
}


def model_for(name: str):
    kwargs = dict(CONFIGS[name][0])
    kind = kwargs.pop("kind", "featured")
    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return mlp_model() if kind == "mlp" else featured_model(**kwargs)


def _recomputing(plan: ExecutionPlan) -> ExecutionPlan:
    pipes = tuple(Pipeline(p.devices, p.layers, p.micro_batches, (True,) * p.num_stages)
                  for p in plan.pipelines)
    return ExecutionPlan(plan.policy, plan.generation, pipes, plan.spare_devices,
                         plan.failed_devices, plan.reroute).validate()


def plans() -> dict[str, ExecutionPlan]:
    split = ((0, 4), (4, 7))
    symmetric = ExecutionPlan("initial", 0, tuple(
        Pipeline((2 * p, 2 * p + 1), split, 2) for p in range(3)), spare_devices=(6,))
    asymmetric = ExecutionPlan("replan", 1, (
        Pipeline((0, 1), ((0, 4), (4, 7)), 2),
        Pipeline((2, 3), ((0, 3), (3, 7)), 1),
        Pipeline((4, 5, 6), ((0, 2), (2, 5), (5, 7)), 3)))
    four = tuple(Pipeline((2 * p, 2 * p + 1), split, q) for p, q in enumerate((2, 2, 1, 1)))
    rerouted = ExecutionPlan("reroute", 1, four, failed_devices=(7,), reroute=(
        Reroute(7, 3, 1, (PeerShare(1, 1), PeerShare(3, 0), PeerShare(5, 0))),))
    return {"symmetric": symmetric.validate(), "asymmetric": asymmetric.validate(),
            "rerouted": rerouted.validate()}


def _train_all(rank: int, world: int):
    out = {}
    for name, (_, options, recompute) in CONFIGS.items():
        for kind, plan in plans().items():
            if recompute:
                plan = _recomputing(plan)
            device = dense_rank_map(plan).device_of_rank[rank]
            trainer = PipelineTrainer(model_for(name), plan, device, micro_batch_size=MBS,
                                      **options)
            results = [trainer.step(t) for t in range(STEPS)]
            state = {layer: {k: v.double().numpy() for k, v in params.items()}
                     for layer, params in trainer.state().items()}
            trainer.close()
            out[name, kind] = ([(r.loss, r.grad_norm, r.lr, r.skipped) for r in results], state,
                               trainer.working)
    return out


@pytest.fixture(scope="module")
def runs():
    assert {p.global_micro_batches for p in plans().values()} == {6}
    return run_local_world(_train_all, 7, timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_feature_trains_like_single_process_under_every_plan_kind(name, runs):
    _, options, _ = CONFIGS[name]
    ref = reference_run(model_for(name), STEPS, 6, MBS, **options)
    exact = "precision" not in options
    rtol, atol = (1e-9, 1e-11) if exact else (2e-3, 1e-6)
    ref_state = {i: {k: v.detach().double().numpy() for k, v in m.state_dict().items()}
                 for i, m in enumerate(ref.layers)}
    if "max_grad_norm" in options:
        assert max(ref.grad_norms) > CLIP   # clipping bites in some step
    for kind in plans():
        for per_rank, (steps, state, working) in ((r, runs[r][name, kind]) for r in range(7)):
            losses, norms, lrs, skipped = (list(x) for x in zip(*steps))
            np.testing.assert_allclose(losses, ref.losses, rtol=rtol, atol=atol,
                                       err_msg=f"{name} {kind} rank {per_rank} loss")
            np.testing.assert_allclose(losses[0], ref.losses[0], rtol=min(rtol, 1e-6),
                                       err_msg=f"{name} {kind} rank {per_rank} step 0 loss")
            np.testing.assert_allclose(norms, ref.grad_norms, rtol=rtol if exact else 1e-2,
                                       err_msg=f"{name} {kind} rank {per_rank} gradient norm")
            if working:   # a spare has no optimizer, hence no learning rate
                assert lrs == pytest.approx(ref.lrs, rel=1e-12), f"{name} {kind} learning rates"
            assert not any(skipped) or options.get("precision") == "fp16"
            if not exact:
                continue
            for layer, params in state.items():
                for pname, value in params.items():
                    np.testing.assert_allclose(value, ref_state[layer][pname], rtol=rtol,
                                               atol=atol, err_msg=f"{name} {kind} {layer} {pname}")
    assert not math.isnan(ref.grad_norms[0])


CHAINED = ("all", "groups", "dropout_recompute", "bf16", "fp16")


def _chain(rank: int, world: int, directory: str):
    """Per config: 2 steps under each plan kind in the same live trainer (layers, tied copies,
    optimizer state, schedule and loss scale move with every plan change), a checkpoint, then
    a fresh trainer that restores it and trains 2 more steps."""
    out = {}
    for name in CHAINED:
        _, options, recompute = CONFIGS[name]
        kinds = list(plans().values())
        if recompute:
            kinds = [_recomputing(p) for p in kinds]
        device = dense_rank_map(kinds[0]).device_of_rank[rank]
        trainer = PipelineTrainer(model_for(name), kinds[0], device, micro_batch_size=MBS,
                                  **options)
        steps = []
        for i, plan in enumerate(kinds):
            if i:
                trainer.release_groups()
                assert dense_rank_map(plan).device_of_rank[rank] == device
                trainer.enter(plan, None)
            steps += [trainer.step(trainer.committed) for _ in range(2)]
        save_checkpoint(trainer, Path(directory) / name, trainer.committed)
        trainer.close()
        restored = PipelineTrainer(model_for(name), kinds[0], device, micro_batch_size=MBS,
                                   checkpoint_dir=Path(directory) / name, **options)
        assert restored.committed == 2 * len(kinds)
        steps += [restored.step(restored.committed) for _ in range(2)]
        restored.close()
        out[name] = [(r.loss, r.grad_norm, r.lr) for r in steps]
    return out


@pytest.mark.timeout(120)
def test_features_survive_plan_changes_in_place_and_a_checkpoint(tmp_path):
    chains = run_local_world(_chain, 7, str(tmp_path), timeout_s=100)
    for name in CHAINED:
        _, options, _ = CONFIGS[name]
        ref = reference_run(model_for(name), 8, 6, MBS, **options)
        exact = "precision" not in options
        losses, norms, lrs = (list(x) for x in zip(*chains[0][name]))   # rank 0 works always
        np.testing.assert_allclose(losses, ref.losses, rtol=1e-9 if exact else 2e-3,
                                   err_msg=f"{name} losses across plan changes and a restore")
        np.testing.assert_allclose(norms, ref.grad_norms, rtol=1e-9 if exact else 1e-2,
                                   err_msg=f"{name} gradient norms")
        assert lrs == pytest.approx(ref.lrs, rel=1e-12), f"{name} schedule"


def _with_user_state(rank: int, world: int, directory: str):
    """An EMA of every layer's weights (per-layer state) and a step counter (job-wide) through
    2 steps under each plan kind in live trainers, where rank 2 enters the rerouted plan as a
    new process (it joins in place: layers, EMA and counter come from its peers), a
    checkpoint, and a fresh trainer that restores it and trains 2 more steps."""
    name = "all"
    _, options, _ = CONFIGS[name]
    kinds = list(plans().values())
    device = dense_rank_map(kinds[0]).device_of_rank[rank]
    state = {"layer_state": {"ema": WeightEMA}}

    def trainer_for(plan, **more):
        return PipelineTrainer(model_for(name), plan, device, micro_batch_size=MBS,
                               job_state={"counter": StepCounter()}, **state, **options, **more)

    trainer = trainer_for(kinds[0])
    for i, plan in enumerate(kinds):
        if i and rank == 2 and i == len(kinds) - 1:
            trainer.close()
            trainer = trainer_for(plan)   # a new process's trainer: it holds nothing
        elif i:
            trainer.release_groups()
            trainer.enter(plan, None)
        for _ in range(2):
            trainer.step(trainer.committed)
    live = _user_state_of(trainer)
    save_checkpoint(trainer, directory, trainer.committed)
    trainer.close()
    restored = trainer_for(kinds[0], checkpoint_dir=directory)
    for _ in range(2):
        restored.step(restored.committed)
    restored.close()
    return live, _user_state_of(restored)


def _user_state_of(trainer):
    counter = trainer.job_state["counter"]
    emas = {layer: {k: v.clone().numpy() for k, v in objects["ema"].shadow.items()}
            for layer, objects in trainer.extras.items()}
    return (counter.steps, counter.last), emas


@pytest.mark.timeout(120)
def test_user_state_rides_through_plan_changes_a_join_and_a_checkpoint(tmp_path):
    """The EMA equals single-process training's EMA at rtol 1e-9; the counter saw every step
    once, on every rank."""
    out = run_local_world(_with_user_state, 7, str(tmp_path), timeout_s=100)
    ema: dict[int, dict[str, torch.Tensor]] = {}

    def update(step, layers):
        for i, layer in enumerate(layers):
            for k, p in layer.named_parameters():
                old = ema.setdefault(i, {}).get(k)
                ema[i][k] = p.detach().clone() if old is None else 0.9 * old + 0.1 * p.detach()

    model = model_for("all")
    initial = reference_run(model, 0, 6, MBS).layers   # EMA starts at the initial weights
    ema.update({i: {k: p.detach().clone() for k, p in m.named_parameters()}
                for i, m in enumerate(initial)})
    snapshots = {}

    def update_and_keep(step, layers):
        update(step, layers)
        snapshots[step] = {i: {k: v.clone() for k, v in e.items()} for i, e in ema.items()}

    reference_run(model, 8, 6, MBS, after_step=update_and_keep, **CONFIGS["all"][1])
    for phase, steps in (("live", 6), ("restored", 8)):
        held = set()
        for rank, states in enumerate(out):
            counter, emas = states[phase == "restored"]
            assert counter == (steps, steps - 1), f"rank {rank}'s counter, {phase}"
            for layer, shadow in emas.items():
                held.add(layer)
                for k, value in shadow.items():
                    np.testing.assert_allclose(
                        value, snapshots[steps - 1][layer][k].numpy(), rtol=1e-9, atol=1e-11,
                        err_msg=f"{phase}: rank {rank} layer {layer} EMA of {k}")
        assert held == set(range(model.num_layers))
        assert out[2][0][1], "the joining rank holds layers with their EMA"
    assert not np.allclose(ema[0]["linear.weight"], initial[0].linear.weight.detach())


def test_loss_scale_follows_torchs_grad_scaler():
    """Same scale as torch's GradScaler (defaults) over overflows and a growth interval."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    ours = LossScale.for_precision("fp16")
    pattern = [math.inf, 1.0, math.nan, *([1.0] * (LossScale.GROWTH_INTERVAL + 3)), math.inf]
    for norm in pattern:
        scaler.scale(torch.ones(()))   # lazily creates the scale, as a real loss would
        param.grad = torch.tensor([norm * scaler.get_scale()])
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        assert ours.skips(norm) == (not math.isfinite(norm))
        ours = ours.after(norm)
        assert ours.scale == scaler.get_scale()
    assert ours.scale == 2.0 ** 14   # two halvings, one doubling, one halving from 2^16
    assert LossScale.for_precision("bf16").after(math.inf).scale == 1.0
