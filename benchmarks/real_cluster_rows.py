"""The paper's real-cluster rows: throughput after one fault, by the planner's own estimate.

    python benchmarks/real_cluster_rows.py [--json]

The paper (Chameleon, INFOCOM) ran Llama-2-7B on Ascend 910B NPUs as (PP, DP, TP) = (4, 2, 1)
on 8, (4, 4, 1) on 16 and (2, 2, 8) on 32, and reports after one failure 96.22%, 89.00% and
74.38% of the original throughput on 7, 15 and 24 devices, and for 24 devices 99.17% of the
theoretical maximum (linear scaling: 24/32 of the original).

Each row here: the job's initial plan, card 0 fails (on 32 cards it takes its 8-card unit,
leaving 24), the planner decides exactly as ``chameleon-plan --fail 0`` does, and the chosen
plan's estimated throughput is given as a share of the initial plan's and of the linear
maximum (live cards / cards x the initial plan's). These are the estimator's figures, not
measurements: docs/estimator.md says where and why they differ from the paper's.

Jobs: ``llama2-7b-910b`` (8), that preset on 16 devices with dp = 4 and 64 micro-batches (16
per pipeline, as the 8-device preset has), and ``llama2-7b-910b-tp8`` (32). The sensitivity
table recomputes the 32-card row at the paper's other batch sizes (16, 32) and at lower
``training.tp_efficiency`` (0.5, 0.75), the figures the preset had to choose without a
measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

from chameleon_elastic.console import make_console
from chameleon_elastic.planning import decide, initial_plan, unit_spec
from chameleon_elastic.spec import JobSpec, units_of

#: The paper's figures by card count: % of the original throughput, % of the linear maximum.
PAPER = {8: 96.22, 16: 89.00, 32: 74.38}
PAPER_OF_LINEAR = {32: 99.17}


@dataclass(frozen=True)
class Row:
    job: str
    cards: int
    pp: int                         # the initial layout, in units
    dp: int
    tp: int
    batch: int
    tp_efficiency: float
    failed_card: int
    cards_left: int
    policy: str
    pipelines: list[int]            # stages (units) per pipeline of the chosen plan
    quotas: list[int]               # micro-batches per pipeline
    original_throughput: float      # samples/s, initial plan
    throughput: float               # samples/s, chosen plan
    of_original: float              # %
    of_linear: float                # % of (cards left / cards) x original
    paper_of_original: float | None
    paper_of_linear: float | None


def sixteen() -> JobSpec:
    """The paper's 16-device run, (PP, DP, TP) = (4, 4, 1): llama2-7b-910b's figures on 16
    devices, 64 micro-batches (16 per pipeline, as the 8-device preset has)."""
    base = JobSpec.preset("llama2-7b-910b")
    return replace(base, name="llama2-7b-910b-x16",
                   cluster=replace(base.cluster, devices=16),
                   training=replace(base.training, dp=4, global_micro_batches=64))


def one_fault(job: JobSpec, card: int = 0) -> Row:
    """What the planner chooses when ``card`` fails on the job's initial plan, priced."""
    spec = unit_spec(job)
    tp = job.training.tp
    start = initial_plan(spec)
    chosen = decide(spec, start, units_of([card], tp)).chosen
    assert start.estimate is not None and chosen.estimate is not None
    left = len(chosen.live_devices) * tp
    ratio = chosen.estimate.throughput / start.estimate.throughput
    cards = job.cluster.devices
    return Row(
        job=job.name, cards=cards, pp=job.training.pp, dp=job.training.dp, tp=tp,
        batch=job.training.global_micro_batches, tp_efficiency=job.training.tp_efficiency,
        failed_card=card, cards_left=left,
        policy=chosen.policy, pipelines=[p.num_stages for p in chosen.pipelines],
        quotas=[p.micro_batches for p in chosen.pipelines],
        original_throughput=start.estimate.throughput, throughput=chosen.estimate.throughput,
        of_original=100.0 * ratio, of_linear=100.0 * ratio * cards / left,
        paper_of_original=PAPER.get(cards), paper_of_linear=PAPER_OF_LINEAR.get(cards),
    )


def paper_rows() -> list[Row]:
    """The three real-cluster rows, 8, 16 and 32 cards, card 0 failing in each."""
    return [one_fault(JobSpec.preset("llama2-7b-910b")), one_fault(sixteen()),
            one_fault(JobSpec.preset("llama2-7b-910b-tp8"))]


def sensitivity() -> list[Row]:
    """The 32-card row at batch 16, 32, 64 and tp_efficiency 0.5, 0.75, 1.0."""
    base = JobSpec.preset("llama2-7b-910b-tp8")
    return [one_fault(replace(base, training=replace(base.training, global_micro_batches=b,
                                                     tp_efficiency=e)))
            for b in (16, 32, 64) for e in (0.5, 0.75, 1.0)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    rows, sweep = paper_rows(), sensitivity()
    if args.json:
        json.dump({"benchmark": "real_cluster_rows", "rows": [asdict(r) for r in rows],
                   "sensitivity": [asdict(r) for r in sweep]}, sys.stdout, indent=2)
        print()
        return 0
    from rich.table import Table

    console = make_console()
    table = Table(title="one fault on the paper's real-cluster settings (estimated)")
    for col in ("job", "(PP, DP, TP)", "cards left", "chosen", "of original",
                "paper: of original", "of linear max", "paper: of linear max"):
        table.add_column(col, justify="left" if col in ("job", "chosen") else "right")
    for r in rows:
        table.add_row(r.job, f"({r.pp}, {r.dp}, {r.tp})", f"{r.cards_left}/{r.cards}",
                      f"{r.policy} {r.pipelines} x {r.quotas}", _pct(r.of_original),
                      _pct(r.paper_of_original), _pct(r.of_linear), _pct(r.paper_of_linear))
    console.print(table)
    table = Table(title="llama2-7b-910b-tp8, card 0 fails: batch and tp_efficiency")
    for col in ("batch", "tp_efficiency", "chosen", "of original", "of linear max"):
        table.add_column(col, justify="left" if col == "chosen" else "right")
    for r in sweep:
        table.add_row(str(r.batch), f"{r.tp_efficiency:g}", f"{r.policy} {r.pipelines} x "
                      f"{r.quotas}", _pct(r.of_original), _pct(r.of_linear))
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
