"""Datasets and evaluation under any plan.

- Epochs: positions read every sample exactly once per epoch (``drop_last``: every sample the
  epoch keeps), from a permutation that is a pure function of (seed, epoch).
- A counting model (layer 0 holds one weight per sample; SGD moves it by exactly -1 each time
  its sample is trained in a committed step) reads a dataset that logs every index it serves,
  with read-ahead on: across two epochs, a re-plan, a reroute, and a recovery from a
  checkpoint that redoes an abandoned step, every sample is trained exactly once per epoch.
- Evaluation: the mean held-out loss under a symmetric (with a spare), an asymmetric and a
  rerouted plan equals single-process evaluation (float64, rtol 1e-9), with a last
  micro-batch that is only partly filled; through ``trainer.run(evaluate=Every(K, ...))`` it
  arrives on the reported steps.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from chameleon_elastic.models.toy import (
    RegressionData,
    mlp_model,
    reference_evaluation,
    reference_run,
)
from chameleon_elastic.plan import ExecutionPlan, PeerShare, Pipeline, Reroute
from chameleon_elastic.runtime import Every, PipelineModel, PipelineTrainer, save_checkpoint
from chameleon_elastic.runtime.data import Epochs, permutation
from chameleon_elastic.runtime.errors import PipelineRuntimeError
from chameleon_elastic.runtime.execution.evaluation import evaluate
from chameleon_elastic.runtime.model import read_samples, sample_indices
from chameleon_elastic.runtime.topology import dense_rank_map
from chameleon_elastic.runtime.world.local_world import run_local_world

MBS = 2
G = 4          # global micro-batches of every plan below
N = 24         # samples: 3 steps of G * MBS = 8 per epoch
LAYERS = 4


# ---------------------------------------------------------------- epochs, without processes

@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("length", [24, 27])
def test_positions_read_each_sample_once_per_epoch(length, drop_last):
    epochs = Epochs(length, seed=3, drop_last=drop_last, batch=8)
    per = epochs.per_epoch
    assert per == (length - length % 8 if drop_last else length)
    seen = [epochs.indices(range(e * per, (e + 1) * per)) for e in range(3)]
    for e, indices in enumerate(seen):
        assert len(set(indices)) == per and set(indices) <= set(range(length)), f"epoch {e}"
        assert epochs.epoch(e * per) == e and epochs.epoch((e + 1) * per - 1) == e
    assert seen[0] != seen[1] != seen[2]   # each epoch its own order
    # a pure function of (seed, epoch): computed again, apart, in another order
    assert Epochs(length, seed=3, drop_last=drop_last, batch=8).indices(
        range(2 * per, 3 * per)) == seen[2]
    assert torch.equal(permutation(3, 1, length), permutation(3, 1, length))
    assert Epochs(length, seed=4, batch=8).indices(range(per)) != seen[0]
    assert Epochs(length, shuffle=False).indices(range(length + 2)) == [
        *range(length), 0, 1]


def test_drop_last_needs_a_step_per_epoch():
    with pytest.raises(PipelineRuntimeError, match="leaves no step"):
        Epochs(5, drop_last=True, batch=8)


def test_a_model_takes_exactly_one_data_source_and_a_map_style_dataset():
    base = mlp_model()
    kwargs = {"num_layers": 2, "build_layer": base.build_layer, "loss": base.loss,
              "make_optimizer": base.make_optimizer}
    with pytest.raises(PipelineRuntimeError, match="exactly one of sample= .* and dataset="):
        PipelineModel(**kwargs)
    with pytest.raises(PipelineRuntimeError, match="exactly one"):
        PipelineModel(**kwargs, sample=base.sample, dataset=RegressionData(4))
    with pytest.raises(PipelineRuntimeError, match="no __getitem__ and __len__"):
        PipelineModel(**kwargs, dataset=iter(range(3)))
    with pytest.raises(PipelineRuntimeError, match="is empty"):
        PipelineModel(**kwargs, dataset=[])
    assert sample_indices(base, range(5, 8), 8) == [5, 6, 7]   # sample(index): the position


class _Batched:
    """A dataset that is read through ``__getitems__`` when it can be."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        raise AssertionError("read one by one although __getitems__ exists")

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        return [(torch.tensor(float(i)), torch.tensor(0.0)) for i in indices]


def test_a_dataset_with_getitems_is_read_a_micro_batch_at_a_time():
    data = _Batched()
    pairs = read_samples(data, [3, 1, 4])
    assert data.calls == [[3, 1, 4]] and [float(x) for x, _ in pairs] == [3.0, 1.0, 4.0]


# ---------------------------------------------------------------- the counting model

class _Counts(nn.Module):
    """Layer 0: one weight per sample, looked up by the sample's index."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(length, dtype=torch.float64))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.w[index].unsqueeze(1)


class _Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


def _counting_layer(i: int, length: int) -> nn.Module:
    return _Counts(length) if i == 0 else _Shift()


def _mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.mean()


def _sgd(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


class _LoggedIndices(torch.utils.data.Dataset):
    """Sample ``i`` is its own index; every read is appended to ``served-<pid>.txt``."""

    def __init__(self, length: int, directory: str) -> None:
        self.length, self.directory = length, directory

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        raise AssertionError("the runtime reads micro-batches through __getitems__")

    def __getitems__(self, indices):
        with open(os.path.join(self.directory, f"served-{os.getpid()}.txt"), "a") as fh:
            fh.write(" ".join(str(i) for i in indices) + "\n")
        return [(torch.tensor(i), torch.tensor(0.0, dtype=torch.float64)) for i in indices]


def counting_model(directory: str) -> PipelineModel:
    """Each training of a sample moves its weight by exactly -1: d(loss)/dw = 1 / (G * MBS)
    per sample (the loss is a micro-batch mean, divided by G), and lr = G * MBS (powers of
    two: exact)."""
    return PipelineModel(
        num_layers=LAYERS, build_layer=functools.partial(_counting_layer, length=N),
        loss=_mean, make_optimizer=functools.partial(_sgd, lr=float(G * MBS)),
        dataset=_LoggedIndices(N, directory), seed=11)


def five_device_plans() -> dict[str, ExecutionPlan]:
    """Three plans of 5 live devices with G = 4: symmetric with a spare, asymmetric, and a
    rerouted 3 x 2 layout whose dead device 5 is served by device 1."""
    half = ((0, 2), (2, 4))
    symmetric = ExecutionPlan("initial", 0, (Pipeline((0, 1), half, 2),
                                             Pipeline((2, 3), half, 2)), spare_devices=(4,))
    asymmetric = ExecutionPlan("replan", 1, (
        Pipeline((0, 1, 2), ((0, 1), (1, 2), (2, 4)), 3),
        Pipeline((3, 4), ((0, 3), (3, 4)), 1)))
    rerouted = ExecutionPlan("reroute", 2, (
        Pipeline((0, 1), half, 2), Pipeline((2, 3), half, 1), Pipeline((4, 5), half, 1)),
        failed_devices=(5,), reroute=(Reroute(5, 2, 1, (PeerShare(1, 1),)),))
    plans = {"symmetric": symmetric, "asymmetric": asymmetric, "rerouted": rerouted}
    for plan in plans.values():
        plan.validate()
        assert plan.global_micro_batches == G
    return plans


def _counts(trainer: PipelineTrainer) -> list[float] | None:
    return trainer.state()[0]["w"].tolist() if 0 in trainer.layers else None


def _count_samples(rank: int, world: int, directory: str) -> dict:
    plans = list(five_device_plans().values())
    device = dense_rank_map(plans[0]).device_of_rank[rank]
    model = counting_model(directory)
    ckpt = Path(directory) / "ckpt"
    trainer = PipelineTrainer(model, plans[0], device, micro_batch_size=MBS)
    seen = {}
    for i, plan in enumerate(plans):           # steps 0-1, 2-3, 4: a re-plan, a reroute
        if i:
            trainer.release_groups()
            assert dense_rank_map(plan).device_of_rank[rank] == device
            trainer.enter(plan, None)
        if i == 2:
            save_checkpoint(trainer, ckpt, 4)  # step 4 is not in it: its training is lost
        for _ in range(2 if i < 2 else 1):
            trainer.step(trainer.committed)
            seen[trainer.committed] = _counts(trainer)
    trainer.close()
    restored = PipelineTrainer(model, plans[1], device, micro_batch_size=MBS,
                               checkpoint_dir=ckpt)
    assert restored.committed == 4
    restored.run(6)                            # steps 4 (again) and 5: the end of epoch 1
    seen[6] = _counts(restored)
    restored.close()
    return seen


@pytest.mark.timeout(120)
def test_every_sample_is_trained_exactly_once_per_epoch_through_plan_changes(tmp_path):
    runs = run_local_world(_count_samples, 5, str(tmp_path), timeout_s=100)
    counts = runs[0]   # device 0 holds layer 0 under every plan
    epochs = Epochs(N, seed=11, batch=G * MBS)
    order = epochs.indices(range(6 * G * MBS))
    for committed, w in counts.items():
        trained = order[:committed * G * MBS]
        expected = [-float(trained.count(i)) for i in range(N)]
        assert w == expected, f"after {committed} steps"
    assert counts[3] == [-1.0] * N and counts[6] == [-2.0] * N   # two whole epochs
    served = [line.split() for f in tmp_path.glob("served-*.txt")
              for line in f.read_text().splitlines()]
    assert served and all(len(batch) == MBS for batch in served)   # micro-batch reads
    assert {int(i) for batch in served for i in batch} == set(range(N))


# ---------------------------------------------------------------- evaluation

EVAL = 19   # held-out samples: 10 micro-batches of 2, the last one holding 1, over 3 rounds


def _eval_model():
    return mlp_model(layers=LAYERS, width=8, dataset=RegressionData(N, width=8))


def _held_out():
    return RegressionData(EVAL, width=8, seed=5)


def _evaluate_under_plans(rank: int, world: int, profile_dir: str) -> dict:
    out = {}
    for name, plan in five_device_plans().items():
        device = dense_rank_map(plan).device_of_rank[rank]
        trainer = PipelineTrainer(_eval_model(), plan, device, micro_batch_size=MBS)
        before = evaluate(trainer, _held_out())
        for _ in range(2):
            trainer.step(trainer.committed)
        out[name] = (before, evaluate(trainer, _held_out()))
        trainer.close()
    plan = five_device_plans()["symmetric"]   # device 4 is a spare
    device = dense_rank_map(plan).device_of_rank[rank]
    os.environ.update(CHAMELEON_PROFILE_DIR=profile_dir, CHAMELEON_DEVICE=str(device))
    trainer = PipelineTrainer(_eval_model(), plan, device, micro_batch_size=MBS)
    reported, mine = [], []
    trainer.run(3, reported.append, evaluate=Every(2, _held_out()), on_step=mine.append)
    out["run"] = [(r.step, r.eval_loss) for r in reported]
    out["on_step"] = [(r.step, r.compute_s, r.data_s, r.step_s) for r in mine]
    trainer.close()
    return out


@pytest.mark.timeout(120)
def test_evaluation_equals_single_process_under_every_plan_kind(tmp_path):
    runs = run_local_world(_evaluate_under_plans, 5, str(tmp_path), timeout_s=100)
    expected = [reference_evaluation(_eval_model(), reference_run(_eval_model(), steps, G,
                                                                  MBS).layers, _held_out())
                for steps in range(4)]
    assert len(set(expected)) == 4   # training moves the held-out loss
    for rank, out in enumerate(runs):
        for name in five_device_plans():
            np.testing.assert_allclose(out[name], [expected[0], expected[2]], rtol=1e-9,
                                       err_msg=f"{name} plan, rank {rank}")
    reported = runs[0]["run"]    # rank 0 reports for the job
    assert [s for s, _ in reported] == [0, 1, 2]
    assert np.isnan(reported[0][1])
    np.testing.assert_allclose([loss for _, loss in reported[1:]], expected[2:], rtol=1e-9)
    assert all(out["run"] == [] for out in runs[1:])
    # on_step: every process, each step it trained, with its own times
    for rank, out in enumerate(runs):
        assert [s for s, *_ in out["on_step"]] == [0, 1, 2], f"rank {rank}"
        assert all(0 <= data <= compute <= step for _, compute, data, step in out["on_step"])
    # every working device recorded its steps for chameleon-run --profile-out; the spare not
    recorded = {int(f.stem.split("-")[1]): len(f.read_text().splitlines())
                for f in tmp_path.glob("device-*.jsonl")}
    assert recorded == {0: 3, 1: 3, 2: 3, 3: 3}


# ---------------------------------------------------------------- the feed alone

@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [False, True])
def test_read_ahead_gives_the_micro_batches_the_plan_assigns(processes):
    """Threads or worker processes, what arrives is what the step's positions read; what was
    read for an abandoned plan is not served under the next one."""
    from chameleon_elastic.runtime.execution.feed import Feed
    from chameleon_elastic.runtime.model import collate

    plans = five_device_plans()
    model = mlp_model(layers=LAYERS, width=8, dataset=RegressionData(N, width=8))
    feed = Feed(model, MBS, workers=2, processes=processes)
    try:
        for name, step in (("symmetric", 0), ("symmetric", 1), ("asymmetric", 2)):
            plan = plans[name]
            wanted = [(p, m) for p, pipe in enumerate(plan.pipelines)
                      for m in range(pipe.micro_batches)]
            feed.begin(plan, step, wanted)
            assert {k[0] for k in feed._ahead} == {step, step + 1}   # this step and the next
            for p, m in wanted:
                x, y = feed.batch(plan, step, p, m)
                ex, ey = collate(model, feed.indices(plan, step, p, m))
                assert torch.equal(x, ex) and torch.equal(y, ey), (name, step, p, m)
    finally:
        feed.close()


def test_bad_evaluation_and_reader_settings_are_one_sentence():
    with pytest.raises(PipelineRuntimeError, match="every 1 or more steps"):
        Every(0, RegressionData(4))
    with pytest.raises(PipelineRuntimeError, match="the evaluation dataset is a"):
        Every(2, iter(range(4)))
    from chameleon_elastic.runtime.execution.feed import Feed

    with pytest.raises(PipelineRuntimeError, match="at least one background reader"):
        Feed(mlp_model(), 1, workers=0)


def _evaluate_sharded(rank: int, world: int) -> float:
    from chameleon_elastic.models.toy import tp_mlp_model

    plan = ExecutionPlan("initial", 0, (Pipeline((0, 1), ((0, 3), (3, 6)), G),)).validate()
    ranks = dense_rank_map(plan, 2)
    trainer = PipelineTrainer(tp_mlp_model(), plan, ranks.device_of_rank[rank],
                              micro_batch_size=MBS, tp_rank=ranks.tp_rank_of_rank[rank],
                              tp_size=2)
    trainer.step(0)
    loss = evaluate(trainer, _held_out())
    trainer.close()
    return loss


@pytest.mark.timeout(120)
def test_evaluation_of_units_of_two_cards_equals_single_process():
    """Tensor parallelism: every card of a unit runs the forwards, card 0 of the last stage
    counts the loss once."""
    from chameleon_elastic.models.toy import tp_mlp_model

    losses = run_local_world(_evaluate_sharded, 4, timeout_s=100)
    expected = reference_evaluation(tp_mlp_model(), reference_run(tp_mlp_model(), 1, G,
                                                                  MBS).layers, _held_out())
    np.testing.assert_allclose(losses, [expected] * 4, rtol=1e-9)
