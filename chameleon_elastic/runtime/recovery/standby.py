"""A standby worker: warm, idle, outside every process group, until a plan gives it a place.

``chameleon-run --job`` starts one on each device beyond the job's size (``training.dp x
training.pp``; the plan's spare devices) as

    python -u -m chameleon_elastic.runtime.recovery.standby SCRIPT ARGS...    (or ``-m MODULE ARGS...``)

It pays what a fresh worker pays before it can train (the interpreter, ``import torch``, the
runtime and what torch imports lazily, :func:`.join.preload_before_groups`), registers on its
agent's channel (so that the job can still recover in place), and sleeps on its doorbell. It
holds no layers, takes part in no collective and trains nothing, so it costs the job's steps
nothing. The agent rings the bell with every generation it publishes; the first whose world
names this device (a swap put it in a lost device's place, or, in place, it is kept as a spare)
ends the wait: the environment is made to describe that generation (``RANK``, ``WORLD_SIZE``,
``MASTER_*``, ``CHAMELEON_*``, as :func:`.join.generation_env` makes it for a worker that
regroups), and the script runs in this very process, as ``python SCRIPT ARGS`` would run it.
On the runtime it then joins that generation, takes its layers from their holders and trains.

Nothing it waits on can hang it: its agent starts it with a death signal (``orphan_guard``),
so it ends with its agent; when the job ends on the other nodes, its agent stops it
(launcher/reactions.py). A script that never runs on the runtime does not reach it: such a job
never recovers in place, so its standbys are stopped and started again with every relaunch.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Sequence

from chameleon_elastic.channel import Generation

from ..world.join import generation_env, note_waited, preload_before_groups
from ..world.link import WorkerLink

__all__ = ["main", "wait_for_place"]


def wait_for_place(link: WorkerLink) -> Generation:
    """The first generation whose world names this device (the newest one, when it already
    does). The bell is cleared before the newest generation is read, so a ring cannot be lost
    between the read and the wait (channel.py)."""
    while True:
        newest = link.newest()
        if newest >= 0:
            gen = link.generation(newest)
            if link.device in gen.world:
                return gen
        try:
            link.wait_for_bell()
        except RuntimeError:   # the store's timeout: nothing published meanwhile, wait on
            continue


def _run(argv: Sequence[str]) -> None:
    """Run the script (``SCRIPT ARGS`` or ``-m MODULE ARGS``) as ``__main__``, as python
    would: its arguments in ``sys.argv``, its directory first on the path."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m chameleon_elastic.runtime.recovery.standby SCRIPT [ARGS...] "
                         "(chameleon-run starts it on standby devices)")
    preload_before_groups()
    link = WorkerLink.from_env()
    if link is None:
        raise SystemExit("chameleon_elastic.runtime.recovery.standby runs under chameleon-run --job "
                         "only (CHAMELEON_AGENT_STORE is not set)")
    link.register(-1)   # no generation yet: in place stays possible while it waits
    began = time.perf_counter()
    place = wait_for_place(link)
    note_waited(time.perf_counter() - began)   # not part of its start-up (hang.py)
    os.environ.update(generation_env(place, link))
    link.store = None   # the script opens its own connection
    _run(argv)


if __name__ == "__main__":
    main()
