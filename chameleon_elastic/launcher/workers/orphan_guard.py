"""No orphans: a worker dies with its agent, even when the agent is killed with SIGKILL.

torch starts each worker in a new session (``start_new_session=True``), so killing the agent's
process group does not reach them, and a SIGKILLed agent cannot forward anything. On Linux we
therefore start every worker through a few lines of Python that ask the kernel for
``PR_SET_PDEATHSIG = SIGKILL`` and then ``exec`` the real command: the pid, the arguments and the
environment are the worker's own (``exec`` keeps the death signal), and when the agent's thread
that started it dies the kernel kills the worker. If the agent died between ``fork`` and
``prctl``, the guard sees it has been re-parented and exits at once.

Only string entry points (a script or a binary, torchrun's normal case) are wrapped; callable
entry points (``--run-path``) run in torch's multiprocessing context unguarded.
"""

from __future__ import annotations

import os
import sys

__all__ = ["GUARD_SOURCE", "guard_supported", "guarded_command"]

GUARD_SOURCE = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(137)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def guard_supported() -> bool:
    return sys.platform.startswith("linux")


def guarded_command(entrypoint: str, args: tuple[str, ...],
                    parent_pid: int | None = None) -> tuple[str, tuple[str, ...]]:
    """(entrypoint, args) that run ``entrypoint *args`` under the death-signal guard."""
    if not guard_supported():
        return entrypoint, args
    pid = os.getpid() if parent_pid is None else parent_pid
    return sys.executable, ("-S", "-c", GUARD_SOURCE, str(pid), entrypoint, *args)
