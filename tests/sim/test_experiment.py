"""Statistics over seeds: ratios are paired per trace, spreads are sample statistics."""

from __future__ import annotations

import statistics

import pytest

from chameleon_elastic.sim.experiment import Spread, run_experiment
from chameleon_elastic.sim.traces import poisson_trace
from chameleon_elastic.spec import JobSpec


def test_spread_of_values() -> None:
    s = Spread.of([1.0, 2.0, 4.0])
    assert (s.mean, s.min, s.max, s.n) == (pytest.approx(7 / 3), 1.0, 4.0, 3)
    assert s.std == pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))
    assert Spread.of([5.0]).std == 0.0
    assert Spread.of([]).n == 0


@pytest.mark.timeout(60)
def test_ratios_are_paired_per_seed() -> None:
    spec = JobSpec.preset("llama2-7b-910b")
    traces = [(s, poisson_trace(8, 0.5, 2.0, seed=s)) for s in (3, 4, 5)]
    result = run_experiment(spec, traces, ("chameleon", "recycle"))
    per_seed = [a.avg_throughput / b.avg_throughput
                for a, b in zip(result.summaries["chameleon"], result.summaries["recycle"])]
    ratio = result.ratio("chameleon", "recycle")
    assert ratio.mean == pytest.approx(statistics.fmean(per_seed))
    assert ratio.n == 3 and ratio.min == pytest.approx(min(per_seed))
    assert [s.seed for s in result.summaries["recycle"]] == [3, 4, 5]


def test_traces_of_another_size_are_rejected() -> None:
    spec = JobSpec.preset("llama2-7b-910b")
    with pytest.raises(ValueError, match="covers 32 devices"):
        run_experiment(spec, [(0, poisson_trace(32, 0.1, 1.0, seed=0))], ("recycle",))
