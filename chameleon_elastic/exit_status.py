"""The exit statuses of ``chameleon-run``, and what a scheduler should do with each.

torchrun's meanings are kept (0 success, 1 failure, 2 usage error); two are added so that a
scheduler can tell a job worth running again from one that is not:

=====  ================  ==================================================================
code   name              meaning, and what a scheduler does
=====  ================  ==================================================================
0      SUCCESS           every worker finished: done
1      FAILED            workers failed for good (restart budget spent, a crash, the
                         rendezvous unreachable or closed, failures that kept coming back):
                         retryable, requeue (it resumes from its last checkpoint)
2      USAGE             a flag, a job file or a profile is wrong (torchrun's, argparse's):
                         do not requeue, fix the command
75     PREEMPTED         stopped by a preemption signal (SIGTERM, or SIGUSR1/SIGUSR2 given in
                         ``--signals-to-handle``) after committing a checkpoint at a step
                         boundary where it could: requeue; the same command goes on at the next
                         step. (``EX_TEMPFAIL`` of sysexits.h: "try again later".)
93     DO_NOT_REQUEUE    no plan can run the job on the devices left (too few devices, nothing
                         fits): running it again on the same allocation fails the same way;
                         or every replica of some layers was lost and the job keeps no
                         checkpoint to restore them from: a requeue would silently start over
                         from step 0, with nothing to stop the same loss; the fix is the
                         command (a checkpoint directory). (NVIDIA's fault-tolerant launcher
                         uses 93 for "do not requeue".)
=====  ================  ==================================================================

It lives at the top of the package, beside the channel, because both sides use it: the agent
exits with it, and a runtime worker stopped by a preemption exits with ``PREEMPTED``.
docs/launcher.md has the table with the Slurm and Kubernetes settings that act on each code.
"""

from __future__ import annotations

import enum

__all__ = ["ExitStatus"]


class ExitStatus(enum.IntEnum):
    SUCCESS = 0
    FAILED = 1
    USAGE = 2
    PREEMPTED = 75
    DO_NOT_REQUEUE = 93
