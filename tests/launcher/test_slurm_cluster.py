"""A real Slurm: slurmctld and slurmd (Debian's slurm-wlm) on this machine, a 2-task sbatch job
whose tasks are two chameleon-run "nodes" training the tiny GPT on etcd-v3, preempted by
``scancel --signal=USR1`` and submitted again: it must exit 75, resume at the next step and
print the losses of an uninterrupted job.

Opt-in, since it needs root and Slurm's daemons: ``CHAMELEON_TEST_SLURM=1`` with slurm-wlm and
munge installed (``apt-get install -y slurm-wlm``; nothing is installed here). The daemons run
with a configuration of their own on free ports, and are stopped at the end."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chameleon_elastic.exit_status import ExitStatus
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd

from .conftest import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "train_gpt.py"
STEP_LINE = re.compile(r"^step +(\d+) +loss (\d+\.\d{4})", re.MULTILINE)

pytestmark = [
    pytest.mark.skipif(os.environ.get("CHAMELEON_TEST_SLURM") != "1",
                       reason="a real Slurm test: set CHAMELEON_TEST_SLURM=1 (needs root, "
                              "slurm-wlm and munge)"),
    pytest.mark.skipif(shutil.which("slurmctld") is None or shutil.which("munge") is None,
                       reason="slurm-wlm and munge are not installed (apt-get install -y "
                              "slurm-wlm)"),
]


def _conf(directory: Path) -> Path:
    host = socket.gethostname().split(".")[0]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 8 // 10
    for sub in ("spool", "state"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    conf = directory / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=chameleon", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none", "ReturnToService=2",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        f"SlurmdSpoolDir={directory / 'spool'}", f"StateSaveLocation={directory / 'state'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd.log'}", "KillWait=30",
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory={memory} State=UNKNOWN",
        (f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP "
         "OverSubscribe=FORCE:4"), ""]))
    return conf


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """slurmctld + slurmd on free ports; the environment for sbatch/scancel/squeue."""
    directory = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_CONF=str(_conf(directory)))
    if subprocess.run(["munge", "-n"], check=False, capture_output=True).returncode != 0:
        subprocess.run(["munged", "--force"], check=True)
    conf = env["SLURM_CONF"]
    daemons = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
               for command in (["slurmctld", "-D", "-c", "-f", conf], ["slurmd", "-D", "-f", conf])]

    def idle() -> bool:
        return "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, check=False,
                                        capture_output=True, text=True).stdout

    try:
        wait_for(idle, 30, "slurmd to register with slurmctld (sinfo idle)")
        yield env
    finally:
        subprocess.run(["scancel", "--partition", "test"], env=env, check=False,
                       capture_output=True)
        for daemon in daemons:
            daemon.terminate()
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[str]:
    server = LocalEtcd(data_dir=tmp_path_factory.mktemp("etcd"))
    try:
        server.start()
        yield server.endpoint
    finally:
        server.stop(kill=True)


def _script(tmp: Path, etcd: str, checkpoints: Path) -> Path:
    script = tmp / "train.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --output={tmp}/job-%j.out
export PYTHONPATH={ROOT} OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
srun --ntasks=2 --kill-on-bad-exit=0 {sys.executable} -m chameleon_elastic.launcher.cli \\
    --nnodes 2 --nproc-per-node 2 --rdzv-backend etcd-v3 --rdzv-endpoint {etcd} --no-status \\
    --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --preset tiny-cpu \\
    {GPT} --steps 40 --log-every 1 --precision fp32 \\
    --checkpoint-dir {checkpoints} --checkpoint-every 5
echo "srun-status=$?"
""")
    return script


def _submit(env: dict, script: Path) -> tuple[str, Path]:
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, check=True,
                         capture_output=True, text=True).stdout.strip().split(";")[0]
    return out, script.parent / f"job-{out}.out"


def _status(log: Path, timeout: float) -> int:
    found = wait_for(lambda: log.exists() and re.search(r"srun-status=(\d+)", log.read_text()),
                     timeout, f"the Slurm job writing {log.name} to end")
    return int(found.group(1))


def _losses(text: str) -> dict[int, str]:
    return {int(s): loss for s, loss in STEP_LINE.findall(text)}


@pytest.mark.timeout(420)
def test_a_preempted_slurm_job_exits_75_and_its_resubmission_resumes_exactly(slurm, etcd,
                                                                            tmp_path):
    base = tmp_path / "baseline"
    base.mkdir()
    _, log = _submit(slurm, _script(base, etcd, base / "ckpt"))
    assert _status(log, 150) == 0, log.read_text()[-2000:]
    uninterrupted = _losses(log.read_text())
    assert sorted(uninterrupted) == list(range(40))

    job, log = _submit(slurm, _script(tmp_path, etcd, tmp_path / "ckpt"))
    wait_for(lambda: log.exists() and re.search(r"^step +10 ", log.read_text(), re.MULTILINE),
             120, "step 10 in the Slurm job's output")
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    assert _status(log, 60) == ExitStatus.PREEMPTED, log.read_text()[-2000:]
    first = log.read_text()
    done = _losses(first)
    last = max(done)
    assert "preempted (SIGUSR1): every worker stopped after step" in first
    assert f"under Slurm job {job}" in first and f"--rdzv-id slurm-{job}" in first

    _, log = _submit(slurm, _script(tmp_path, etcd, tmp_path / "ckpt"))
    assert _status(log, 150) == 0, log.read_text()[-2000:]
    rest = _losses(log.read_text())
    assert f"resumed from the checkpoint after step {last}" in log.read_text()
    assert sorted(rest) == list(range(last + 1, 40))
    assert {**done, **rest} == uninterrupted
