"""Execution plan: JSON round-trip, derived views and structural validation."""

import pytest

from chameleon_elastic.plan import (
    CHECKPOINT,
    AllReduceGroup,
    Estimate,
    ExecutionPlan,
    PeerShare,
    Pipeline,
    PlanError,
    Reroute,
    Transfer,
)


def rerouted_plan() -> ExecutionPlan:
    pipes = tuple(
        Pipeline(devices=(2 * i, 2 * i + 1), layers=((0, 3), (3, 6)), micro_batches=5)
        for i in range(3)
    )
    return ExecutionPlan(
        policy="reroute",
        generation=2,
        pipelines=pipes,
        spare_devices=(6,),
        failed_devices=(3,),
        reroute=(Reroute(3, 1, 1, (PeerShare(1, 3), PeerShare(5, 2))),),
        transfers=(Transfer(0, 6, (0, 1), 10.0),),
        allreduce_rounds=((AllReduceGroup((0, 1, 2), (0, 2, 4)), AllReduceGroup((3, 4, 5), (1, 5))),),
        estimate=Estimate(1.5, 0.0, {0: 1.0, 1: 2.0}, 10.0, 9.5),
    )


def test_json_round_trip_keeps_everything():
    plan = rerouted_plan().validate()
    back = ExecutionPlan.from_json(plan.to_json())
    assert back == plan
    assert back.estimate == plan.estimate
    data = plan.to_dict()
    assert data["pipelines"][0] == {"devices": [0, 1], "layers": [[0, 3], [3, 6]],
                                    "micro_batches": 5, "recompute": [False, False]}
    assert data["reroute"][0]["peers"] == [{"device": 1, "micro_batches": 3},
                                           {"device": 5, "micro_batches": 2}]


def test_derived_views():
    plan = rerouted_plan()
    assert plan.live_devices == (0, 1, 2, 4, 5, 6)
    assert plan.working_devices == (0, 1, 2, 4, 5)
    assert plan.global_micro_batches == 15
    assert [plan.micro_batch_offset(i) for i in range(3)] == [0, 5, 10]
    assert [plan.server(1, 1, m) for m in range(5)] == [1, 5, 1, 5, 1]
    assert plan.server(1, 0, 0) == 2
    roles = {r.device: r for r in plan.roles()}
    assert set(roles) == {0, 1, 2, 4, 5}
    assert roles[1].micro_batches == 8 and roles[5].micro_batches == 7
    assert (roles[2].pipeline, roles[2].stage, roles[2].layer_start, roles[2].layer_end) == (1, 0, 0, 3)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d["pipelines"][0].update(layers=[[0, 2], [3, 6]]), "contiguously"),
        (lambda d: d["pipelines"][0].update(devices=[0, 2]), "twice"),
        (lambda d: d.update(spare_devices=[1]), "spare device 1"),
        (lambda d: d.update(policy="magic"), "unknown policy"),
        (lambda d: d["reroute"][0].update(
            peers=[{"device": 1, "micro_batches": 2}, {"device": 5, "micro_batches": 3}]), "round-robin"),
        (lambda d: d["reroute"][0]["peers"][0].update(device=0), "exactly layers"),
        (lambda d: d.update(reroute=[]), "reroute entry"),
        (lambda d: d["pipelines"][2].update(layers=[[0, 3], [3, 7]]), "instead of"),
        (lambda d: d.pop("pipelines"), "malformed"),
    ],
)
def test_validation_rejects_broken_plans(mutate, words):
    data = rerouted_plan().to_dict()
    mutate(data)
    with pytest.raises(PlanError, match=words):
        ExecutionPlan.from_dict(data)


def test_bad_json_is_a_plan_error():
    with pytest.raises(PlanError, match="not valid JSON"):
        ExecutionPlan.from_json("{")


def test_checkpoint_transfers_round_trip_through_json():
    lost = (Transfer(CHECKPOINT, 6, (3, 4, 5), 30.0), Transfer("checkpoint", 0, (4,), 10.0))
    plan = ExecutionPlan("replan", 3, rerouted_plan().pipelines[:1], spare_devices=(6,),
                         transfers=(Transfer(1, 6, (0, 1), 10.0), *lost)).validate()
    data = plan.to_dict()
    assert [t["src"] for t in data["transfers"]] == [1, "checkpoint", "checkpoint"]
    back = ExecutionPlan.from_json(plan.to_json())
    assert back == plan
    assert [t.from_checkpoint for t in back.transfers] == [False, True, True]
    assert back.checkpoint_layers == (3, 4, 5)
    assert rerouted_plan().checkpoint_layers == ()


@pytest.mark.parametrize("src", ["ckpt", "3", None, [1]])
def test_a_transfer_source_is_a_device_or_the_checkpoint(src):
    data = rerouted_plan().to_dict()
    data["transfers"][0]["src"] = src
    with pytest.raises(PlanError):
        ExecutionPlan.from_dict(data)
    with pytest.raises(PlanError, match="expected a device id or 'checkpoint'"):
        Transfer("disk", 0, (1,), 1.0)


def test_recompute_flags_round_trip_and_default_to_none():
    pipe = Pipeline((0, 1), ((0, 3), (3, 6)), 5, (True, False))
    plan = ExecutionPlan("initial", 0, (pipe,)).validate()
    data = plan.to_dict()
    assert data["pipelines"][0]["recompute"] == [True, False]
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    # Old JSON without the key: no stage recomputes; the same as saying so.
    del data["pipelines"][0]["recompute"]
    old = ExecutionPlan.from_dict(data)
    assert old.pipelines[0].recompute == (False, False)
    assert old.pipelines[0] == Pipeline((0, 1), ((0, 3), (3, 6)), 5, (False, False))
    roles = {r.device: r.recompute for r in plan.roles()}
    assert roles == {0: True, 1: False}


@pytest.mark.parametrize("flags, words", [
    ([True], "1 recompute flags for 2 stages"),
    ([True, False, True], "3 recompute flags"),
    (["yes", False], "list of true/false"),
    ([1, 0], "list of true/false"),
    ("true", "list of true/false"),
])
def test_bad_recompute_flags_are_rejected(flags, words):
    data = rerouted_plan().to_dict()
    data["pipelines"][1]["recompute"] = flags
    with pytest.raises(PlanError, match=words):
        ExecutionPlan.from_dict(data)
