"""In-memory snapshots end to end: chameleon-run, real gloo workers, a real ``kill -9``, a float64
model. When a loss takes every holder of some layers, the survivors go back to the newest
snapshot every layer shares (kept in host memory, a partner's on another node) and train the
steps since again, with the same data; the result equals single-process training (rtol 1e-9).
"""

from __future__ import annotations

import json
import os
import signal
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from .conftest import MLP_FAULTS, mlp_reference, read_events, wait_for

# a loaded host makes devices look slow, and a straggler's re-plan starts a plan generation,
# which takes a snapshot at its first step: the snapshot a loss goes back to would then depend
# on the load
CALM = ("--stragglers", "off")


def _job(directory: Path) -> Path:
    """The tiny-cpu-pp4 preset (one pipeline of four stages: every stage has a single
    replica) as a job file."""
    job = directory / "pp4.toml"
    job.write_text(resources.files("chameleon_elastic.presets").joinpath(
        "tiny-cpu-pp4.toml").read_text())
    return job


def _default_every(job: Path, per_node: int) -> int:
    """The interval chameleon-run takes for ``job`` when no flag says otherwise."""
    from dataclasses import replace

    from chameleon_elastic.planning import resolve_snapshots
    from chameleon_elastic.spec import JobSpec

    spec = JobSpec.from_toml(job)
    spec = replace(spec, cluster=replace(spec.cluster, devices_per_node=per_node))
    return resolve_snapshots(spec).recovery.snapshot_every


def _reported(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]


def _assert_restored_from_a_snapshot(out: Path, state: Path, survivors: list[int], steps: int,
                                     newest: tuple[int, int]) -> int:
    """Every step printed once as trained and the rolled-back ones once more marked trained
    again, each loss and every survivor's final layers equal to single-process training, the
    survivors in their first processes; returns the snapshot's step, which must lie in
    ``newest`` (the last multiple of the interval sealed before the loss, and the step before
    it: a plan generation that began in between takes one at its first step too, e.g. a
    straggler's re-plan on a loaded host)."""
    reported = _reported(out)
    assert [r["step"] for r in reported if not r["redone"]] == list(range(steps))
    again = [r["step"] for r in reported if r["redone"]]
    assert again, "no step was trained again"
    resume = again[0]
    assert newest[0] <= resume <= newest[1] and again == list(range(resume, again[-1] + 1))
    ref_losses, ref_params = mlp_reference(steps)
    np.testing.assert_allclose([r["loss"] for r in reported],
                               [ref_losses[r["step"]] for r in reported], rtol=1e-9, atol=1e-12)
    # what a person compares: the last five printed losses, to 4 decimals
    assert [f"{r['loss']:.4f}" for r in reported[-5:]] == [
        f"{ref_losses[s]:.4f}" for s in range(steps - 5, steps)]
    held = set()
    for device in survivors:
        assert len((out / f"pid-{device}").read_text().split()) == 1
        for layer, tensors in torch.load(out / f"params-{device}.pt", weights_only=True).items():
            held.add(layer)
            for name, value in tensors.items():
                np.testing.assert_allclose(value.numpy(), ref_params[layer][name].numpy(),
                                           rtol=1e-9, atol=1e-12)
    assert held == set(ref_params)
    recovered = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"]
    r = recovered[-1]
    assert (r["mode"], r["source"], r["resumed_step"]) == ("inplace", "snapshot", resume)
    assert r["redone_steps"] == len(again)
    return resume


@pytest.mark.timeout(90)
def test_a_stage_with_one_replica_lost_comes_back_from_a_snapshot(tmp_path, launch):
    """One pipeline of four stages on one node, no checkpoint directory: device 2 is killed
    (SIGKILL) after step 10. Its layers exist nowhere else, but its partner keeps a snapshot:
    the survivors go back to it and finish."""
    job = _job(tmp_path)
    every = _default_every(job, 4)
    steps = 16
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--job", str(job),
                               *CALM, "--state-dir", str(state), "--monitor-interval", "0.05",
                               "--no-status", MLP_FAULTS, str(out), str(steps),
                               "2:11:forward:kill"])
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    # snapshot 8 at the default 4, sealed by step 9
    resume = _assert_restored_from_a_snapshot(out, state, [0, 1, 3], steps,
                                              (10 // every * every, 10))
    log = run.log.read_text()
    line = next(x for x in log.splitlines() if "lost (SIGKILL)" in x)
    assert f"restored from the in-memory snapshot of step {resume}" in line
    assert "Traceback" not in log


@pytest.mark.timeout(120)
def test_the_node_holding_two_stages_lost_on_etcd_v3_comes_back_from_snapshots(tmp_path,
                                                                                launch):
    """The same job on two nodes of two (etcd-v3): the node holding stages 2-3 is SIGKILLed,
    agent and workers, after step 10. The other node keeps both stages' snapshots (each
    device's partner sits on the other node) and finishes alone."""
    local_etcd = pytest.importorskip("chameleon_elastic.rendezvous.local_etcd")
    job = _job(tmp_path)
    every = _default_every(job, 2)
    steps = 16
    out = tmp_path / "out"
    out.mkdir()
    with local_etcd.LocalEtcd(data_dir=tmp_path / "etcd") as etcd:
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd-v3",
                  "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "snapshot-node",
                  "--rdzv-conf", "last_call_timeout=5,lease_ttl=2", "--local-addr", "127.0.0.1",
                  "--monitor-interval", "0.1", "--no-status", "--job", str(job), *CALM]
        agents = {name: launch("chameleon", [*common, "--state-dir", str(tmp_path / name),
                                             MLP_FAULTS, str(out), str(steps), "--pace", "0.3",
                                             "--min-world", "4"], name=name)
                  for name in ("a", "b")}
        wait_for(lambda: (out / "steps.jsonl").exists() and len(_reported(out)) >= 11, 90,
                 "steps 0-10 reported")
        # devices are node * 2 + local rank: group rank 1 holds devices 2 and 3
        holder = next(name for name in agents if _group_rank(tmp_path / name) == 1)
        os.kill(agents[holder].proc.pid, signal.SIGKILL)   # its workers die with it
        agents[holder].proc.wait(10)
        survivor = next(a for name, a in agents.items() if name != holder)
        assert survivor.wait(90) == 0, survivor.log.read_text()[-3000:]
    state = tmp_path / next(name for name in agents if name != holder)
    _assert_restored_from_a_snapshot(out, state, [0, 1], steps, (10 // every * every, steps))
    assert "Traceback" not in survivor.log.read_text()


def _group_rank(state: Path) -> int | None:
    events = [e for e in read_events(state / "events.jsonl") if e["event"] == "rendezvous"]
    return events[-1]["group_rank"] if events else None


@pytest.mark.timeout(90)
def test_a_second_loss_during_the_first_ones_transition_comes_back_from_snapshots(tmp_path,
                                                                                   launch):
    """tiny-cpu's pipelines (0 1) and (2 3): device 3 dies in step 5, device 1 as it enters
    the plan made for that. Layers 4-7 then have no live holder and there is no checkpoint
    (the job used to end there); devices 0 and 2 keep 3's and 1's snapshots."""
    steps = 9
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--preset", "tiny-cpu",
                               "--snapshot-every", "2", *CALM, "--state-dir", str(state),
                               "--monitor-interval", "0.05", "--no-status", MLP_FAULTS,
                               str(out), str(steps), "3:5:forward:kill", "1:5:enter:kill"])
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    _assert_restored_from_a_snapshot(out, state, [0, 2], steps, (4, 4))
    assert "Traceback" not in run.log.read_text()


@pytest.mark.timeout(90)
def test_when_no_snapshot_survives_the_checkpoint_is_restored_and_one_sentence_says_so(
        tmp_path, launch):
    """Devices 2 and 3 die together: device 2's partner is device 3, so layers 4-5 survive in
    no snapshot; the survivors restore the checkpoint of step 6 from disk, and say why."""
    job = _job(tmp_path)
    out, state = tmp_path / "out", tmp_path / "state"
    out.mkdir()
    run = launch("chameleon", ["--standalone", "--nproc-per-node", "4", "--job", str(job),
                               "--snapshot-every", "4", *CALM, "--state-dir", str(state),
                               "--monitor-interval", "0.05", "--no-status", MLP_FAULTS,
                               str(out), "9", "2:7:forward:kill-saved", "3:7:forward:kill-saved",
                               "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert run.wait(80) == 0, run.log.read_text()[-3000:]
    reported = _reported(out)
    assert [(r["step"], r["redone"]) for r in reported] == [
        *((s, False) for s in range(7)), (6, True), (7, False), (8, False)]
    ref_losses, _ = mlp_reference(9)
    np.testing.assert_allclose([r["loss"] for r in reported],
                               [ref_losses[r["step"]] for r in reported], rtol=1e-9, atol=1e-12)
    log = run.log.read_text()
    said = [x for x in log.splitlines() if "no in-memory snapshot" in x]
    assert said == [("chameleon: layers 4-7 were lost with every device that held them and no "
                     "in-memory snapshot of them survived: restoring the checkpoint of step 6 "
                     "from disk.")], said
    r = [e for e in read_events(state / "events.jsonl") if e["event"] == "recovered"][-1]
    assert (r["source"], r["resumed_step"]) == ("checkpoint", 6)
    assert "Traceback" not in log
