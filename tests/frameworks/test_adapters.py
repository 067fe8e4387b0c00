"""The adapters' pure parts: the settings they return from a given environment, the share they
read and announce, the errors they raise, and what importing them pulls in (no framework, no
torch). The Lightning, accelerate and transformers parts build their framework's objects and
are skipped where it is not installed."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

from chameleon_elastic import channel
from chameleon_elastic.frameworks import (
    accelerate_plan,
    following,
    hf_trainer,
    lightning_plan,
    share,
)
from chameleon_elastic.frameworks.share import PlanShare, ShareError

#: a survivor under a re-plan: device 1, now rank 0 of 1, on slot 1 of a node of 2, with the
#: lost worker's micro-batches
SURVIVOR = {"CHAMELEON_PLAN_GENERATION": "1", "RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "CHAMELEON_MICRO_BATCHES": "4",
            "CHAMELEON_MICRO_BATCH_SIZE": "8", "CHAMELEON_GLOBAL_MICRO_BATCHES": "4",
            "CHAMELEON_NUM_STAGES": "1", "CHAMELEON_TP_SIZE": "1", "CHAMELEON_DEVICE": "1",
            "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    """Each test starts with no generation announced (the set is process-wide)."""
    monkeypatch.setattr(following, "_ANNOUNCED", set())


def test_importing_the_adapters_imports_no_framework_and_no_torch():
    code = ("import sys; import chameleon_elastic.frameworks.lightning_plan, "
            "chameleon_elastic.frameworks.hf_trainer, chameleon_elastic.frameworks.accelerate_plan;"
            " bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pytorch_lightning', "
            "'lightning', 'lightning_fabric', 'transformers', 'accelerate')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_share_round_trips_from_the_environment():
    got = PlanShare.from_env(SURVIVOR)
    assert got == PlanShare(generation=1, rank=0, world_size=1, local_rank=1, micro_batches=4,
                            micro_batch_size=8, global_micro_batches=4, restart_count=0)
    assert (got.global_batch, got.samples_per_step, got.loss_weight) == (32, 32, 1.0)
    assert PlanShare.from_env({}) is None


def test_unequal_quotas_weigh_every_sample_alike():
    """8 micro-batches over 3 ranks (3, 3, 2): DDP's mean over ranks of per-rank means, each
    weighed by loss_weight, gives every micro-batch 1/8."""
    weights = [PlanShare(0, r, 3, r, q, 1, 8).loss_weight for r, q in enumerate((3, 3, 2))]
    per_micro_batch = [w / q / 3 for w, q in zip(weights, (3, 3, 2))]
    assert per_micro_batch == pytest.approx([1 / 8] * 3)


@pytest.mark.parametrize(("change", "says"), [
    ({"CHAMELEON_MICRO_BATCHES": None}, "no role in the plan"),
    ({"CHAMELEON_NUM_STAGES": "2"}, "pipeline of 2 stages"),
    ({"CHAMELEON_TP_SIZE": "2"}, "tensor-parallel"),
    ({"WORLD_SIZE": "two"}, "malformed"),
    ({"RANK": None}, "incomplete"),
])
def test_a_share_that_cannot_be_followed_is_refused_in_one_sentence(change, says):
    env = {k: v for k, v in {**SURVIVOR, **change}.items() if v is not None}
    with pytest.raises(ShareError, match=says):
        following.follow(env)


def test_without_a_plan_every_adapter_hands_back_the_script_s_own_settings():
    assert hf_trainer.training_args(per_device_train_batch_size=16,
                                    gradient_accumulation_steps=2, env={}) == {
        "per_device_train_batch_size": 16, "gradient_accumulation_steps": 2}
    assert accelerate_plan.accelerator_kwargs(gradient_accumulation_steps=3, env={}) == {
        "gradient_accumulation_steps": 3}
    assert lightning_plan.trainer_kwargs(devices=2, num_nodes=1, accumulate_grad_batches=5,
                                         strategy="ddp", env={}) == {
        "devices": 2, "num_nodes": 1, "accumulate_grad_batches": 5, "strategy": "ddp"}
    assert following.micro_batch_size(6, env={}) == 6
    assert following.loss_weight(env={}) == 1.0


def test_under_a_plan_the_hf_trainer_takes_the_plan_s_batch_and_accumulation():
    assert hf_trainer.training_args(per_device_train_batch_size=16,
                                    gradient_accumulation_steps=2, env=SURVIVOR) == {
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4}
    assert following.micro_batch_size(6, env=SURVIVOR) == 8


def test_the_newest_complete_hf_checkpoint_is_the_one_resumed(tmp_path):
    assert hf_trainer.last_checkpoint(tmp_path / "none") is None
    for step, complete in ((3, True), (10, True), (11, False)):   # 11: killed while saving
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert hf_trainer.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


def test_the_agent_is_told_once_per_generation(monkeypatch):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    env = {**SURVIVOR, channel.AGENT_STORE_ENV: f"127.0.0.1:{server.port}"}
    calls = []
    monkeypatch.setattr(following, "announce",
                        lambda s, e: calls.append(s.generation) or share.announce(s, e))
    for _ in range(3):
        assert following.follow(env).generation == 1
    assert calls == [1]
    assert channel.read(server, channel.follows_key(1)) == 1


def test_an_unreachable_agent_costs_a_warning_not_the_run():
    env = {**SURVIVOR, channel.AGENT_STORE_ENV: "127.0.0.1:not-a-port"}
    with pytest.warns(RuntimeWarning, match="could not tell the agent"):
        assert following.follow(env).micro_batches == 4


def test_lightning_progress_is_restated_in_the_new_plan_s_micro_batches():
    """An epoch-end checkpoint of 2 ranks x 2 micro-batches (6 batches per rank, taken in
    on_train_batch_end: completed one behind) reads, for 1 rank x 4, as 12 batches done."""
    progress = {"total": {"ready": 6, "started": 6, "processed": 6, "completed": 5},
                "current": {"ready": 6, "started": 6, "processed": 6, "completed": 5},
                "is_last_batch": True}
    checkpoint = {lightning_plan.PLAN_KEY: {"generation": 0, "world_size": 2, "micro_batches": 2},
                  "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    lightning_plan._follow_plan_change(checkpoint, PlanShare.from_env(SURVIVOR), "ckpt")
    assert progress["current"] == {"ready": 12, "started": 12, "processed": 12, "completed": 11}
    assert progress["total"] == progress["current"]


def test_a_mid_epoch_lightning_checkpoint_under_another_plan_is_warned_about():
    progress = {"total": {"ready": 2, "started": 2, "processed": 2, "completed": 1},
                "current": {"ready": 2, "started": 2, "processed": 2, "completed": 1},
                "is_last_batch": False}
    checkpoint = {lightning_plan.PLAN_KEY: {"generation": 0, "world_size": 2, "micro_batches": 2},
                  "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    with pytest.warns(RuntimeWarning, match="mid-epoch"):
        lightning_plan._follow_plan_change(checkpoint, PlanShare.from_env(SURVIVOR), "ckpt")


def test_under_a_plan_lightning_gets_the_slots_the_accumulation_and_a_plan_strategy(
        monkeypatch):
    pytest.importorskip("pytorch_lightning",
                        reason="Lightning: pip install 'chameleon-elastic[frameworks]'")
    for key, value in SURVIVOR.items():
        monkeypatch.setenv(key, value)
    kwargs = lightning_plan.trainer_kwargs(devices=2, num_nodes=1, strategy="ddp",
                                           env=SURVIVOR)
    assert {k: kwargs[k] for k in ("devices", "num_nodes", "accumulate_grad_batches")} == {
        "devices": 2, "num_nodes": 1, "accumulate_grad_batches": 4}
    strategy = kwargs["strategy"]
    environment = strategy.cluster_environment
    assert (environment.global_rank(), environment.world_size(), environment.local_rank(),
            environment.node_rank()) == (0, 1, 1, 0)
    environment.validate_settings(num_devices=2, num_nodes=1)   # world 1 < 2 x 1: fine
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    with pytest.raises(ValueError, match="LOCAL_RANK=1 is no slot of devices=1"):
        environment.validate_settings(num_devices=1, num_nodes=1)
    with pytest.raises(ShareError, match="only DDP"):
        lightning_plan.trainer_kwargs(strategy="fsdp", env=SURVIVOR)


def test_under_a_plan_accelerate_gets_the_plan_s_accumulation_as_a_plugin():
    pytest.importorskip("accelerate", reason="accelerate: pip install 'chameleon-elastic[frameworks]'")
    kwargs = accelerate_plan.accelerator_kwargs(gradient_accumulation_steps=2, env=SURVIVOR)
    assert kwargs["gradient_accumulation_plugin"].num_steps == 4
    assert set(kwargs) == {"gradient_accumulation_plugin"}
