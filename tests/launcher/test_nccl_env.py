"""The watchdog mode chameleon-run gives workers (launcher/workers/worker_env.py): without a job
torchrun's, with one the mode in which NCCL's watchdog tears no survivor down, a user's own
value kept and, when it would tear survivors down, named once at start.

NCCL-only setting, checked without a GPU (this machine has none): only NCCL's watchdog reads
``TORCH_NCCL_ASYNC_ERROR_HANDLING``, so these tests check the value a worker is given and the
line the launcher says, on FAKE launch objects (plain namespaces standing for torch's worker
spec, group and plan assignment), never what a GPU worker then does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from chameleon_elastic.launcher import launch
from chameleon_elastic.launcher.workers import worker_env
from chameleon_elastic.launcher.workers.worker_env import (
    ASYNC_ERROR_HANDLING,
    launch_inputs,
    nccl_watchdog_warning,
)

#: FAKE torch launch objects (a worker spec, its group, one worker): only what the env reads
_SPEC = SimpleNamespace(role="default", local_world_size=1, max_restarts=0, args=("train.py",),
                        entrypoint="python",
                        rdzv_handler=SimpleNamespace(get_run_id=lambda: "run"))
_WG = SimpleNamespace(group_rank=0, group_world_size=1, master_addr="127.0.0.1",
                      master_port=29500)
_WORKER = SimpleNamespace(global_rank=0, role_rank=0, world_size=1, role_world_size=1,
                          local_rank=0)


def _env(monkeypatch, job: bool) -> dict[str, str]:
    """The environment ``launch_inputs`` gives one worker, with a FAKE plan session (the
    plan's own variables stubbed out) when ``job``."""
    monkeypatch.setattr(worker_env.channel, "chameleon_env", lambda *a: {"CHAMELEON_X": "1"})
    monkeypatch.setattr(worker_env.channel, "job_env", lambda spec: {})
    session = SimpleNamespace(plan=None, plan_file="plan.json", spec=None, tp=1) if job else None
    assignment = SimpleNamespace(role=object(), device=0, unit_ranks=(0,), tp_rank=0)
    envs, _, _ = launch_inputs([(_WORKER, assignment if job else None)], _SPEC, _WG, 0,
                               session, "127.0.0.1:1", {}, lambda env, rank, spec: None, None)
    return envs[0]


@pytest.mark.parametrize(("user", "without_job", "with_job"),
                         [(None, "1", "0"), ("1", "1", "1"), ("2", "2", "2"), ("3", "3", "3"),
                          ("0", "0", "0")])
def test_the_watchdog_mode_workers_get(monkeypatch, user, without_job, with_job):
    """NCCL-only variable, no GPU here (FAKE launch objects): without a job, torchrun's value
    (the user's, else 1); with a job, 0 (the watchdog only reports; the runtime aborts), the
    user's own value kept."""
    if user is None:
        monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(ASYNC_ERROR_HANDLING, user)
    assert _env(monkeypatch, job=False)[ASYNC_ERROR_HANDLING] == without_job
    assert _env(monkeypatch, job=True)[ASYNC_ERROR_HANDLING] == with_job


@pytest.mark.parametrize("value", ["1", "3", " 1 "])
def test_a_tear_down_mode_is_named_in_one_sentence(value):
    """NCCL-only setting, no GPU here: a user's 1 or 3 (NCCL's watchdog tears a worker down)
    is named in one line that says what follows and the fix."""
    line = nccl_watchdog_warning({ASYNC_ERROR_HANDLING: value})
    assert line is not None and "\n" not in line
    assert f"{ASYNC_ERROR_HANDLING}={value.strip()}" in line and "set it to 0" in line


@pytest.mark.parametrize("environ", [{}, {ASYNC_ERROR_HANDLING: "0"},
                                     {ASYNC_ERROR_HANDLING: "2"}])
def test_nothing_is_said_of_a_mode_that_tears_nothing_down(environ):
    """NCCL-only setting, no GPU here: unset (the job's 0), 0 or 2 tear no worker down."""
    assert nccl_watchdog_warning(environ) is None


def test_the_launcher_says_it_once_with_a_job_and_never_without(monkeypatch, capsys):
    """NCCL-only setting, no GPU here (a FAKE session): the launch path writes the line once,
    at start, on stderr, with a job; without one chameleon-run is torchrun and says nothing."""
    monkeypatch.setenv(ASYNC_ERROR_HANDLING, "3")
    launch._say_watchdog_mode(None)
    assert capsys.readouterr().err == ""
    launch._say_watchdog_mode(SimpleNamespace())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"chameleon-run: {ASYNC_ERROR_HANDLING}=3")
