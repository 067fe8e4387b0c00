"""Named experiments of ``chameleon-sim --scenario NAME``: the defaults a documented table needs.

Why a name and not a page of flags: docs/sim.md quotes the table a scenario prints, and the one
command beside it must reproduce it. A scenario only fills in what the command line leaves out
(``--preset``, ``--hours``, ``--seeds``, ``--policies``) and turns on the goodput table and
goodput.png; every flag given explicitly wins, so a sensitivity run is the scenario plus the
flag it varies.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCENARIOS", "Scenario", "scenario_lines"]


@dataclass(frozen=True)
class Scenario:
    """The defaults one named experiment sets (see the module docstring)."""

    preset: str
    hours: float
    seeds: int
    policies: str
    what: str


SCENARIOS: dict[str, Scenario] = {
    "goodput-16k": Scenario(
        preset="llama3-405b-h100-16k", hours=24.0, seeds=20,
        policies="chameleon,torchft,nvrx,checkpoint",
        what="goodput at 16,384 H100s, MTTF 1.8 h, one day, 20 traces (docs/sim.md)"),
}


def scenario_lines(indent: str = "  ") -> list[str]:
    """--help lines per scenario: its name, what it is, and what it sets."""
    pad = max((len(n) for n in SCENARIOS), default=0)
    return [line for name, s in SCENARIOS.items() for line in (
        f"{indent}{name:<{pad}}  {s.what}",
        f"{indent}{'':<{pad}}  = --preset {s.preset} --hours {s.hours:g} --seeds {s.seeds}",
        f"{indent}{'':<{pad}}    --policies {s.policies} --goodput")]
