"""In-memory snapshots inside the runtime: what a snapshot holds, and a restore from one.

Pure parts (inventories on the wire, the newest snapshot every layer shares, who sends which
copy) are checked without processes; the copies and the restore in a real gloo world of four
processes training one pipeline of four stages (float64 MLP, SGD with momentum), against
single-process training (rtol 1e-9).
"""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np
import pytest
import torch

from chameleon_elastic.models.toy import mlp_model, reference_training
from chameleon_elastic.plan import ExecutionPlan, Pipeline
from chameleon_elastic.runtime import PipelineTrainer
from chameleon_elastic.runtime.state import snapshots as snapshots_module
from chameleon_elastic.runtime.state.layer_state import unpack
from chameleon_elastic.runtime.state.snapshots import (
    Found,
    Inventory,
    Slot,
    Snapshots,
    _Run,
    newest_common,
    snapshot_moves,
)
from chameleon_elastic.runtime.world.local_world import run_local_world

MBS = 2


def pipeline_of_four(generation: int = 0) -> ExecutionPlan:
    return ExecutionPlan("initial" if generation == 0 else "replan", generation, (
        Pipeline((0, 1, 2, 3), ((0, 2), (2, 4), (4, 6), (6, 7)), 8),)).validate()


def _inv(device: int, slots: dict) -> Inventory:
    return Inventory(device, {s: ((1.0, 0), job, frozenset(layers))
                              for s, (job, layers) in slots.items()})


def test_an_inventory_crosses_the_wire_unchanged():
    inv = Inventory(3, {8: ((65536.0, 7), True, frozenset({4, 5, 6})),
                        4: ((1.0, 0), False, frozenset())})
    assert Inventory.from_tensor(3, inv.to_tensor(7), 7) == inv


def test_the_newest_snapshot_every_layer_shares_is_chosen():
    # snapshot 8: layers 4-5 were with device 2 only (lost) -> not whole; snapshot 4 is
    invs = [_inv(0, {4: (True, {0, 1, 6}), 8: (True, {0, 1, 6})}),
            _inv(1, {4: (True, {2, 3}), 8: (True, {2, 3})}),
            _inv(3, {4: (True, {4, 5, 6}), 8: (True, {6})})]
    found = newest_common(invs, 7)
    assert found is not None and found.step == 4
    assert found.holders == {0: (0,), 1: (0,), 2: (1,), 3: (1,), 4: (3,), 5: (3,), 6: (0, 3)}
    assert found.job == (0, 1, 3)
    # with device 3 gone too, layers 4-5 are in no snapshot
    assert newest_common(invs[:2], 7) is None
    # the job's state must come from somewhere as well
    no_job = [_inv(d, {4: (False, layers)}) for d, layers in ((0, range(4)), (1, range(4, 7)))]
    assert newest_common(no_job, 7) is None


def test_copies_move_only_where_a_device_keeps_none_itself():
    plan = ExecutionPlan("replan", 2, (Pipeline((0, 1), ((0, 4), (4, 7)), 8),)).validate()
    found = Found(4, (1.0, 0), {0: (0,), 1: (0,), 2: (1, 3), 3: (1, 3), 4: (3,), 5: (1, 3),
                                6: (3,)}, (0, 1))
    moves = snapshot_moves(plan, found)
    # device 0 keeps 0-1 itself; 2-3 from 1 and 3 (the one that sent least, then the lowest);
    # device 1 keeps 5 itself, 4 and 6 from 3
    assert [(m.src, m.dst, m.layers) for m in moves] == [
        (1, 0, (2,)), (3, 0, (3,)), (3, 1, (4, 6))]


def _train_lose_and_restore(rank: int, world: int, steps: int, lost: int):
    """Train ``steps`` steps with a snapshot every 2, then device ``lost`` forgets everything
    (a new process in its place) and every rank enters the next generation of the same
    layout; train on to ``steps + 3``."""
    plan = pipeline_of_four()
    trainer = PipelineTrainer(mlp_model(), plan, rank, micro_batch_size=MBS, snapshot_every=2)
    losses = []
    trainer.run(steps, lambda r: losses.append((r.step, r.redone, r.loss)))
    slots = {s: sorted(slot.layers) for s, slot in trainer.snapshots.slots.items()}
    copies = {s: {x: {k: v.numpy() for k, v in unpack(packed, torch.device("cpu")).params.items()}
                  for x, packed in slot.layers.items()}
              for s, slot in trainer.snapshots.slots.items()}
    trainer.snapshots.settle()
    trainer.release_groups()
    if rank == lost:   # what a process started in the lost one's place holds
        trainer.layers, trainer.optimizer, trainer.committed = {}, None, None
        trainer.extras, trainer.scheduler = {}, None
        trainer.snapshots = Snapshots(2)
    entry = trainer.enter(pipeline_of_four(1), None)
    trainer.run(steps + 3, lambda r: losses.append((r.step, r.redone, r.loss)))
    state = {x: {k: v.numpy() for k, v in p.items()} for x, p in trainer.state().items()}
    trainer.close()
    return slots, copies, entry.source, entry.resume, losses, state


@pytest.mark.timeout(90)
def test_snapshots_hold_the_committed_state_and_bring_a_lost_stage_back():
    steps = 5
    out = run_local_world(_train_lose_and_restore, 4, steps, 2, timeout_s=80)
    ref_losses, ref_layers = reference_training(mlp_model(), steps + 3, 8, MBS)
    _, layers_at_4 = reference_training(mlp_model(), 4, 8, MBS)
    for rank, (slots, copies, source, resume, losses, state) in enumerate(out):
        # snapshot 2 sealed, 4 taken in step 4 (0 dropped when 4 began); each device keeps
        # its own layers and its partner's (0->1, 1->2, 2->3, 3->0 on one node)
        mine = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6]}
        partner_of = {1: 0, 2: 1, 3: 2, 0: 3}
        assert sorted(slots) == [2, 4]
        assert slots[4] == sorted(mine[rank] + mine[partner_of[rank]])
        for x, params in copies[4].items():
            for k, v in params.items():
                np.testing.assert_allclose(v, layers_at_4[x].state_dict()[k].numpy(),
                                           rtol=1e-12, atol=0)
        # device 2's layers 4-5 had no live holder: everyone went back to snapshot 4
        assert (source, resume) == ("snapshot", 4)
        for x, params in state.items():
            for k, v in params.items():
                np.testing.assert_allclose(v, ref_layers[x].state_dict()[k].numpy(),
                                           rtol=1e-9, atol=1e-12)
        if rank == 0:   # the reporter: step 4 once as trained, once trained again
            assert [(t, again) for t, again, _ in losses] == [
                (0, False), (1, False), (2, False), (3, False), (4, False), (4, True),
                (5, False), (6, False), (7, False)]
            np.testing.assert_allclose([loss for *_, loss in losses],
                                       [ref_losses[t] for t, *_ in losses],
                                       rtol=1e-9, atol=1e-12)

def test_a_negative_interval_is_refused_in_one_sentence():
    from chameleon_elastic.runtime import PipelineRuntimeError

    with pytest.raises(PipelineRuntimeError, match=r"snapshot_every = -1; pass an interval"):
        Snapshots(-1)


def _running(snapshots: Snapshots, step: int, exchange) -> tuple[_Run, threading.Thread]:
    """Snapshot ``step`` under way: copied, its exchange blocked in ``exchange``."""
    run = _Run(step)
    snapshots.slots[step] = Slot(step, (1.0, 0))

    def take():
        run.copied.set()
        try:
            exchange()
        except RuntimeError as exc:
            run.error = exc

    thread = threading.Thread(target=take, daemon=True)
    snapshots._run, snapshots._thread = run, thread
    thread.start()
    return run, thread


def test_an_exchange_the_cut_missed_is_left_behind_and_its_error_stays_its_own(caplog,
                                                                              monkeypatch):
    """A gloo pair with sends queued to a frozen peer can miss the recovery's cut and wait out
    its timeout (chaos part 12: 13.75 s lost entering a plan). Entering a plan waits for the
    copy, then a short grace: the exchange is left behind, its snapshot not counted, and its
    error, when it comes, never reaches a later snapshot's fence."""
    monkeypatch.setattr(snapshots_module, "EXCHANGE_GRACE_S", 0.2)
    snapshots = Snapshots(4)
    released = threading.Event()

    def stuck():
        released.wait(60)
        raise RuntimeError("Timed out waiting 30000ms for recv operation to complete")

    left, thread = _running(snapshots, 8, stuck)
    snapshots.settle(30)
    assert 8 not in snapshots.slots
    assert "snapshot 8: its exchange with a lost peer did not end at the cut" in caplog.text

    nxt, _ = _running(snapshots, 12, lambda: None)
    released.set()   # the one left behind fails now, beside the next one
    thread.join(60)
    snapshots.fence(12)   # the next one's fence sees only its own outcome
    assert left.error is not None and nxt.error is None and 12 in snapshots.slots


def test_a_slow_exchange_that_ends_is_kept_and_named(caplog, monkeypatch):
    monkeypatch.setattr(snapshots_module, "EXCHANGE_GRACE_S", 60.0)   # never left behind here
    snapshots = Snapshots(4)
    released = threading.Event()
    threading.Timer(1.2, released.set).start()   # ends the "exchange" after 1.2 s at least

    def slow():
        released.wait(60)
        raise RuntimeError("Connection closed by peer")

    _running(snapshots, 12, slow)
    with caplog.at_level(logging.WARNING, logger="chameleon_elastic.runtime.state.snapshots"):
        snapshots.settle(30)
    assert 12 in snapshots.slots
    assert re.search(r"snapshot 12: took \d+\.\d s to end after the failure \(Connection "
                     r"closed by peer\)", caplog.text)


class _SlowToFree:
    """Stands in for a gloo group, whose destructor waits for its device loop (20-30 ms)."""

    def __init__(self, freed: threading.Event) -> None:
        self._freed = freed

    def __del__(self) -> None:
        time.sleep(0.3)
        self._freed.set()


def test_closing_frees_the_snapshot_group_before_it_returns():
    """Entering a plan frees the snapshot group on a thread of its own; closing must wait for
    that thread, since a process that ends while it is inside a group's destructor dies by
    SIGABRT (a CI run: "terminate called without an active exception" after a rejoin)."""
    snapshots, freed = Snapshots(4), threading.Event()
    snapshots._group = _SlowToFree(freed)
    snapshots.close(30)
    assert freed.is_set(), "close returned with the group still being freed"
    assert not [t for t in threading.enumerate() if t.name == "chameleon-free-groups"]


def test_a_packed_copy_lives_in_host_memory_and_unpacks_to_the_state():
    from chameleon_elastic.runtime.state.layer_state import export_layer, pack_layer, unpack

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    before = export_layer(0, layer, optimizer)
    packed = pack_layer(0, layer, optimizer)
    assert all(b.device.type == "cpu" for b in packed[1])
    with torch.no_grad():
        layer.weight.add_(1.0)   # training goes on: the copy does not move with it
    back = unpack(packed, torch.device("cpu"))
    assert torch.equal(back.params["weight"], before.params["weight"])
    assert torch.equal(back.optimizer[0]["exp_avg"], before.optimizer[0]["exp_avg"])
    unpack(packed, torch.device("cpu")).params["weight"].add_(1.0)   # a copy, too
    assert torch.equal(unpack(packed, torch.device("cpu")).params["weight"],
                       before.params["weight"])
