"""The agent's straggler watch (launcher/detection/stragglers.py) on a real store: per-step speeds from
the workers' paces, the threshold/recover band held for a window of steps, and the factors a
new plan brings back."""

from __future__ import annotations

import torch.distributed as dist

from chameleon_elastic import channel
from chameleon_elastic.launcher.detection.stragglers import StragglerWatch, speeds_of
from chameleon_elastic.planning import initial_plan
from chameleon_elastic.planning.estimator import expected_compute
from chameleon_elastic.spec import JobSpec, StragglerSpec

SPEC = JobSpec.preset("tiny-cpu")
PLAN = initial_plan(SPEC)
CARDS = {c: c for c in range(4)}


class Workers:
    """Four workers' paces in a store, each step ``expected / speed`` seconds of compute."""

    def __init__(self, store, generation: int = 0) -> None:
        self.store, self.generation = store, generation
        self.paces = {d: channel.Pace(generation) for d in range(4)}
        self.expected = expected_compute(SPEC, PLAN)

    def step(self, speeds: dict[int, float]) -> None:
        for d, p in self.paces.items():
            busy = self.expected[d] / speeds.get(d, 1.0)
            self.paces[d] = channel.Pace(p.generation, p.steps + 1, p.busy_s + busy,
                                         p.wait_s + 0.01, p.sync_s + 0.002)
            channel.write(self.store, channel.pace_key(d), self.paces[d])


def run(watch: StragglerWatch, workers: Workers, steps: int, speeds: dict[int, float]):
    """The watch's verdict after each of ``steps`` steps (None: nothing to decide)."""
    found = []
    for _ in range(steps):
        workers.step(speeds)
        watch.read(workers.store, CARDS, workers.generation)
        found.append(watch.check(SPEC, PLAN))
    return found


def test_a_device_slow_for_a_window_of_steps_is_named_with_its_speed():
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=3))
    workers = Workers(dist.HashStore())
    assert run(watch, workers, 4, {}) == [None] * 4
    found = run(watch, workers, 3, {3: 0.3})
    assert found[:2] == [None, None]            # 1 and 2 steps slow: not yet a window
    assert found[2] == {3: 0.3}                 # the third slow step makes it
    assert watch.report({2, 3}) == {3: 0.3} and watch.report({0, 1}) == {}
    assert watch.why == {3: "0.30x for 3 steps, 0.7 s lost; a switch ~0.3 s"}


def test_a_slowdown_is_planned_around_only_once_it_has_cost_two_switches():
    """At 0.5x a step of tiny-cpu's expected 0.096 s of compute loses 0.096 s: a window of 3
    steps has lost 0.29 s, less than two in-place switches (2 x 0.3 s); the 7th slow step
    makes it (PAYBACK). A dip of a few steps on a shared machine spends no transition."""
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=3))
    workers = Workers(dist.HashStore())
    run(watch, workers, 2, {})
    found = run(watch, workers, 7, {3: 0.5})
    assert found[:6] == [None] * 6 and found[6] == {3: 0.5}, found
    assert watch.why[3].startswith("0.50x for 7 steps, 0.7 s lost")


def test_short_dips_and_speeds_inside_the_band_decide_nothing():
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=3))
    workers = Workers(dist.HashStore())
    pattern = [{3: 0.5}, {3: 0.5}, {}, {3: 0.5}, {3: 0.5}, {}, {3: 0.8}, {3: 0.8}, {3: 0.8}]
    for speeds in pattern:
        assert run(watch, workers, 1, speeds) == [None]


def test_a_planned_straggler_is_back_only_above_recover_for_a_window():
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=3))
    watch.adopt({3: 0.5})                       # the plan was made for device 3 at half speed
    workers = Workers(dist.HashStore())
    assert run(watch, workers, 4, {3: 0.5}) == [None] * 4   # as planned
    assert run(watch, workers, 4, {3: 0.8}) == [None] * 4   # better, but inside the band
    found = run(watch, workers, 3, {})
    assert found == [None, None, {}]            # back at full speed: planned at 1.0 again
    watch.adopt({})
    assert watch.planned == {} and watch.found is None


def test_a_planned_straggler_that_slows_further_is_named_again():
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=2))
    watch.adopt({3: 0.5})
    workers = Workers(dist.HashStore())
    assert run(watch, workers, 3, {3: 0.25}) == [None, None, {3: 0.25}]


def test_paces_of_an_older_generation_are_ignored():
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=2))
    workers = Workers(dist.HashStore(), generation=0)
    workers.step({3: 0.5})
    workers.step({3: 0.5})
    watch.read(workers.store, CARDS, 1)         # the agent runs generation 1 now
    assert watch.check(SPEC, PLAN) is None


def test_speeds_are_relative_to_the_median_so_a_uniformly_off_profile_names_nobody():
    expected = dict.fromkeys(range(4), 1.0)
    assert speeds_of(expected, dict.fromkeys(range(4), 2.0)) == dict.fromkeys(range(4), 1.0)
    assert speeds_of(expected, {0: 2.0, 1: 2.0, 2: 2.0, 3: 4.0})[3] == 0.5
    assert speeds_of(expected, {0: 1.0, 1: 2.0}) == {0: 1.0, 1: 0.5}   # too few for a median: against the fastest


def test_a_spared_straggler_is_tried_again_after_its_probation_which_then_doubles():
    from dataclasses import replace

    from chameleon_elastic.launcher.detection.stragglers import PROBATION
    from chameleon_elastic.planning.stragglers import spare_plan

    spared = spare_plan(SPEC, PLAN, {3: 0.1})
    assert 3 in spared.spare_devices
    watch = StragglerWatch(StragglerSpec(threshold=0.7, recover=0.9, window=2))
    watch.adopt({3: 0.1})
    workers = Workers(dist.HashStore(), generation=spared.generation)
    workers.expected = expected_compute(SPEC, spared)
    del workers.paces[3]
    found = []
    for _ in range(PROBATION * 2):
        workers.step({})
        watch.read(workers.store, CARDS, spared.generation)
        found.append(watch.check(SPEC, spared))
    assert found[:-1] == [None] * (PROBATION * 2 - 1) and found[-1] == {}
    watch.adopt({3: 0.1})   # still slow: spared again, and it waits twice as long
    workers = Workers(dist.HashStore(), generation=spared.generation + 1)
    workers.expected = expected_compute(SPEC, spared)
    del workers.paces[3]
    again = replace(spared, generation=spared.generation + 1)
    found = []
    for _ in range(PROBATION * 4):
        workers.step({})
        watch.read(workers.store, CARDS, again.generation)
        found.append(watch.check(SPEC, again))
    assert found.count(None) == PROBATION * 4 - 1 and found[-1] == {}
