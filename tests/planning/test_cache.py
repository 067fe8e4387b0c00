"""Plan cache: ahead-of-time re-plans, looked up up to symmetry, equal to fresh searches."""

import itertools
from dataclasses import replace

import pytest

from chameleon_elastic.planning import PlanCache, decide, initial_plan
from chameleon_elastic.planning.search import replan
from chameleon_elastic.spec import JobSpec


def spec8() -> JobSpec:
    return JobSpec.preset("llama2-7b-910b")


def same_quality(a, b):
    assert a.estimate.step_time_s == pytest.approx(b.estimate.step_time_s)
    assert sum(t.bytes for t in a.transfers) == pytest.approx(sum(t.bytes for t in b.transfers))
    assert sorted(p.num_stages for p in a.pipelines) == sorted(p.num_stages for p in b.pipelines)
    assert set(a.live_devices) == set(b.live_devices)


def test_single_failures_collapse_to_one_class_per_stage():
    spec = spec8()
    cache = PlanCache(spec, initial_plan(spec), depth=1)
    assert cache.warm() == spec.training.pp


def test_cached_plans_match_fresh_search_for_every_loss_of_one_or_two():
    spec = spec8()
    plan = initial_plan(spec)
    cache = PlanCache(spec, plan, depth=2)
    cache.warm_in_background().join(timeout=60)
    for k in (1, 2):
        for failed in itertools.combinations(plan.live_devices, k):
            cached = cache.lookup(failed)
            assert cached is not None
            cached.validate()
            assert set(failed).isdisjoint(cached.live_devices)
            fresh = replan(spec, plan, failed)
            same_quality(cached, fresh)
            # dp = 2: when both replicas of a stage are gone, their layers (and only those)
            # come from the checkpoint, in the relabelled plan as in the fresh one.
            assert cached.checkpoint_layers == fresh.checkpoint_layers
            assert all(isinstance(t.src, int) or t.from_checkpoint for t in cached.transfers)


def test_cache_decide_equals_plain_decide_on_hits_and_misses():
    spec = spec8()
    plan = initial_plan(spec)
    cache = PlanCache(spec, plan, depth=2)
    want = decide(spec, plan, [6], price_all=True)
    miss = cache.decide([6], price_all=True)
    assert len(cache) == 0  # a miss is decided on the spot, not stored
    cache.warm()
    hit = cache.decide([6], price_all=True)
    for got in (miss, hit):
        assert got.chosen.policy == want.chosen.policy
        same_quality(got.candidates["replan"], want.candidates["replan"])
        assert got.candidates["reroute"] == want.candidates["reroute"]


def test_cache_decide_agrees_with_decide_when_a_stage_loses_every_replica():
    base = spec8()  # dp = 2 x pp = 4: devices 1 and 5 hold layers [8, 16); spares 8 and 9
    spec = replace(base, cluster=replace(base.cluster, devices=10))
    plan = initial_plan(spec)
    cache = PlanCache(spec, plan, depth=3)
    cache.warm()
    # Spare 9 dies too: the cached plan was made for spare 8 dying, relabelled 8 <-> 9, and its
    # checkpoint sources must survive the relabelling untouched.
    want = decide(spec, plan, [1, 5, 9])
    got = cache.decide([1, 5, 9])
    assert got.chosen.policy == want.chosen.policy == "replan"
    assert got.chosen.checkpoint_layers == want.chosen.checkpoint_layers == tuple(range(8, 16))
    same_quality(got.chosen, want.chosen)
    assert got.chosen.estimate.score == pytest.approx(want.chosen.estimate.score)
    # two devices of the layout lost and one standby (8) live: no swap either
    assert set(got.rejected) == set(want.rejected) == {"reroute", "swap"}
    assert "only 1 standby" in got.rejected["swap"]
    live = set(got.chosen.live_devices)
    assert 8 in live and {1, 5, 9}.isdisjoint(live)
    for t in got.chosen.transfers:
        assert t.dst in live and (t.from_checkpoint or t.src in live)
    assert any(t.from_checkpoint and t.dst == 8 for t in got.chosen.transfers)
