"""chameleon-run under Slurm: the allocation's variables -> torchrun's flags (pure), and one
real launcher started with a step's variables. A real slurmctld/slurmd run is
test_slurm_cluster.py (only with CHAMELEON_TEST_SLURM=1)."""

from __future__ import annotations

import pytest

from chameleon_elastic.launcher.cli import build_parser
from chameleon_elastic.launcher.slurm import (
    SlurmAllocation,
    SlurmError,
    expand_hostlist,
    from_allocation,
)

from .conftest import PROBE

STEP = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-08],cpu3"}


@pytest.mark.parametrize(("text", "hosts"), [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[07-08,10],cpu3", ["gpu07", "gpu08", "gpu10", "cpu3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b", ["a", "b"]),
    ("", []),
])
def test_host_lists_expand_as_scontrol_show_hostnames(text, hosts):
    assert expand_hostlist(text) == hosts


def given(*argv: str) -> dict:
    return vars(build_parser().parse_args([*argv, "train.py"]))


def test_a_step_gives_nodes_run_id_c10d_backend_and_the_first_host():
    alloc = SlurmAllocation.from_env(STEP)
    assert alloc == SlurmAllocation("4711", 3, 2, ("gpu07", "gpu08", "cpu3"), in_step=True)
    assert from_allocation(alloc, given(), standalone=False) == {
        "nnodes": "3", "rdzv_id": "slurm-4711", "rdzv_backend": "c10d",
        "rdzv_endpoint": "gpu07:29400"}


def test_flags_given_win_and_etcd_needs_its_endpoint():
    alloc = SlurmAllocation.from_env(STEP)
    taken = from_allocation(alloc, given("--nnodes", "2:3", "--rdzv-backend", "etcd-v3",
                                         "--rdzv-endpoint", "etcd0:2379", "--rdzv-id", "mine"),
                            standalone=False)
    assert taken == {}
    with pytest.raises(SlurmError, match="pass --rdzv-endpoint host:2379"):
        from_allocation(alloc, given("--rdzv-backend", "etcd-v3"), standalone=False)
    assert from_allocation(alloc, given(), standalone=True) == {}


def test_one_node_keeps_static_with_the_node_rank_and_a_requeue_gets_a_new_run_id():
    alloc = SlurmAllocation.from_env({**STEP, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0",
                                      "SLURM_RESTART_COUNT": "2"})
    assert from_allocation(alloc, given(), standalone=False) == {
        "nnodes": "1", "rdzv_id": "slurm-4711-r2", "node_rank": 0}


def test_outside_slurm_there_is_no_allocation():
    assert SlurmAllocation.from_env({}) is None
    assert SlurmAllocation.from_env({"SLURM_JOB_ID": "5"}).in_step is False


@pytest.mark.timeout(60)
def test_a_launcher_in_a_step_says_what_it_took_and_runs(tmp_path, launch):
    env = {"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}
    run = launch("chameleon", ["--nproc-per-node", "2", "--no-status", PROBE, str(tmp_path),
                               "ok"], env=env)
    assert run.wait(50) == 0, run.log.read_text()[-2000:]
    assert ("chameleon-run: under Slurm job 99 (node 0 of 1): --nnodes 1 --rdzv-id slurm-99 "
            "--node-rank 0 (--slurm off to launch exactly as given)") in run.log.read_text()
    assert len(list(tmp_path.glob("env-*.json"))) == 2


@pytest.mark.timeout(60)
def test_slurm_on_outside_slurm_is_a_usage_error(tmp_path, launch):
    run = launch("chameleon", ["--slurm", "--nproc-per-node", "1", PROBE, str(tmp_path), "ok"])
    assert run.wait(50) == 2
    assert "--slurm: SLURM_JOB_ID is not set" in run.log.read_text()
