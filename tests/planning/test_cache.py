"""Plan cache: ahead-of-time re-plans, looked up up to symmetry, equal to fresh searches."""

import itertools

import pytest

from chameleon_elastic.planning import PlanCache, PlanningError, decide, initial_plan
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
            if k == 2 and plan.locate(failed[0])[1] == plan.locate(failed[1])[1]:
                # dp = 2: both replicas of a stage are gone; the cache remembers why.
                with pytest.raises(PlanningError, match="checkpoint"):
                    cache.lookup(failed)
                continue
            cached = cache.lookup(failed)
            assert cached is not None
            cached.validate()
            assert set(failed).isdisjoint(cached.live_devices)
            same_quality(cached, replan(spec, plan, failed))


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
