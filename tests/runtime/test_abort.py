"""Cutting a generation's sockets (runtime/world/abort.py, ``shut_down``) never leaves a collective
waiting for its timeout: two real gloo processes all-reduce in a loop and both cut their
group's sockets at the same instant, as every survivor's watchdog does when the agents
publish a newer generation. With a ``SHUT_RDWR`` cut, torch 2.13's gloo queued a send written
after the cut without an error and the collective waited out the group timeout in about one
cut in five per rank; each rank's collective must fail at once, every time."""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

TRIALS = 12
GROUP_TIMEOUT_S = 8   # a collective stuck on a queued send fails after this

_RANK = textwrap.dedent("""
    import json, os, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from chameleon_elastic.runtime.world.abort import new_sockets, shut_down

    rank, port, trials, timeout_s = (int(a) for a in sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    for trial in range(trials):
        with new_sockets() as formed:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"{trial}/", store),
                                    rank=rank, world_size=2,
                                    timeout=timedelta(seconds=timeout_s))
            t = torch.ones(1 << 16)
            dist.all_reduce(t)   # every pair is connected, and recorded
        if rank == 0:   # one instant for both: CLOCK_MONOTONIC is the host's
            store.set(f"cut {trial}", str(time.monotonic() + 0.3))
        at = float(store.get(f"cut {trial}"))
        threading.Timer(max(0.0, at - time.monotonic()), shut_down,
                        args=(frozenset(formed),)).start()
        try:
            while True:
                dist.all_reduce(t)
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        print(json.dumps({"trial": trial, "after_s": time.monotonic() - at, "error": error}),
              flush=True)
        dist.destroy_process_group()
        if store.add(f"done {trial}", 1) == 2:
            store.set(f"both done {trial}", "1")
        store.wait([f"both done {trial}"])
    os._exit(0)
""")


def test_a_cut_fails_both_sides_collectives_at_once(ranks):
    _, start = ranks
    procs = start(_RANK, 2, str(TRIALS), str(GROUP_TIMEOUT_S))
    for rank, proc in enumerate(procs):
        for trial in range(TRIALS):
            line = proc.stdout.readline()
            assert line, (f"rank {rank} stopped before trial {trial}'s cut ended: "
                          f"{proc.stderr.read()[-2000:]}")
            said = json.loads(line)
            # a stuck send ends only with the group timeout ("Timed out waiting")
            assert said["after_s"] < GROUP_TIMEOUT_S / 2, (rank, said)
            assert "Timed out" not in said["error"], (rank, said)


_FREE_AT_EXIT = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    from chameleon_elastic.runtime.world.abort import Freeing

    rank, port, count = (int(a) for a in sys.argv[1:4])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    groups = [dist.new_group([0, 1]) for _ in range(count)]
    for group in groups:
        dist.barrier(group)
        dist.destroy_process_group(group)
    Freeing().later(groups)   # 20-30 ms a group, on a daemon thread; the script ends now
    del groups
""")


@pytest.mark.timeout(60)
def test_a_script_that_ends_while_groups_are_being_freed_exits_cleanly(ranks):
    """Groups freed in the background (an abort's, a closing snapshot's) while the script
    ends: the interpreter must not finalise with a thread inside a group's destructor, which
    kills the process by SIGABRT ("terminate called without an active exception"; a CI run
    after a rejoin). Freed so without the join at exit, 40 groups did it on both ranks 6 runs
    of 6."""
    _, start = ranks
    procs = start(_FREE_AT_EXIT, 2, "40")
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=45)
        assert proc.returncode == 0 and "terminate called" not in err, (rank, err[-2000:])
