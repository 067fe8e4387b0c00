"""What a user sees when the etcd of --rdzv-endpoint cannot be reached.

chameleon-run prints one sentence (endpoint, what was tried, the fix) and exits 1, torchrun's
status for a rendezvous error, once the connect attempt gives up: after ``connect_timeout``,
by default 10 s or ``read_timeout`` when smaller. Programs calling ``cli.main(argv)`` get the
exception, as from ``torch.distributed.run.main``; plain torchrun prints its own traceback,
which ends with the same sentence and no longer carries gRPC's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _rdzv_agents import chameleon_run

from chameleon_elastic.rendezvous.errors import EtcdConnectionError
from chameleon_elastic.rendezvous.local_etcd import free_port

pytestmark = pytest.mark.timeout(60)

BIN = Path(sys.executable).parent
# the test's own deadline for a run that must give up after at most 10 s (plus start-up)
DEADLINE_S = 25


def console(name: str, fallback: list[str]) -> list[str]:
    """The installed console script ``name``, else the same entry point through python."""
    script = BIN / name
    return [str(script)] if script.is_file() else fallback


def launch(tmp_path: Path, endpoint: str, *conf: str) -> list[str]:
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('the worker must not start')\n")
    rdzv_conf = ["--rdzv-conf", ",".join(conf)] if conf else []
    return ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, *rdzv_conf,
            "--nnodes", "1:2", "--nproc-per-node", "1", str(script)]


def run(argv: list[str]) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


@pytest.fixture
def not_etcd() -> Iterator[str]:
    """A TCP server on loopback that accepts connections and never says a word."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not)
        server.close()
        thread.join(timeout=5)
        for conn in held:
            conn.close()


def test_chameleon_run_names_the_endpoint_and_the_fix_in_one_sentence(tmp_path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    code, output, took = run([*console("chameleon-run", chameleon_run()),
                              *launch(tmp_path, endpoint)])
    print(f"chameleon-run gave up after {took:.1f} s")
    lines = output.strip().splitlines()
    assert code == 1, output
    assert len(lines) == 1 and "Traceback" not in output, output
    assert lines[0].startswith(f"chameleon-run: no etcd answered at {endpoint} within 10 s")
    assert "connection refused" in lines[0] and "start etcd there" in lines[0]
    assert "--rdzv-endpoint" in lines[0] and "connect_timeout" in lines[0]


def test_listening_non_etcd_endpoint_gives_up_by_read_timeout(tmp_path, not_etcd) -> None:
    code, output, took = run([*console("chameleon-run", chameleon_run()),
                              *launch(tmp_path, not_etcd, "read_timeout=2")])
    print(f"chameleon-run gave up after {took:.1f} s (read_timeout=2)")
    lines = output.strip().splitlines()
    assert code == 1, output
    assert len(lines) == 1 and "Traceback" not in output, output
    assert lines[0].startswith(f"chameleon-run: no etcd answered at {not_etcd} within 2 s")
    assert "did not answer as etcd" in lines[0] and "client URLs" in lines[0]


def test_plain_torchrun_ends_with_the_sentence_without_grpc_frames(tmp_path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    torchrun = console("torchrun", [sys.executable, "-m", "torch.distributed.run"])
    code, output, _ = run([*torchrun, *launch(tmp_path, endpoint, "connect_timeout=1")])
    assert code == 1, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("chameleon_elastic.rendezvous.errors.EtcdConnectionError: no etcd "
                           f"answered at {endpoint} within 1 s")
    # torchrun prints the traceback of an uncaught error (not ours to change); gRPC's
    # chained exception, whose status and details the sentence already carries, is gone
    assert "grpc" not in output.lower() and "direct cause" not in output


def test_main_with_arguments_raises_like_torchrun(tmp_path, monkeypatch) -> None:
    from chameleon_elastic.launcher.cli import main

    # run() sets this for the agent; keep it out of this test process afterwards
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(EtcdConnectionError, match=f"no etcd answered at {endpoint} within 1 s"):
        main(launch(tmp_path, endpoint, "connect_timeout=1"))


def test_a_finished_jobs_rdzv_id_is_refused_with_the_fix(tmp_path, etcd_server) -> None:
    """A job closes its rendezvous when it ends (torchrun's does too); starting another job
    with the same --rdzv-id on the same etcd names that and the fix, in one sentence, exit 1."""
    script = tmp_path / "ok.py"
    script.write_text("print('worker ran')\n")
    argv = [*console("chameleon-run", chameleon_run()), "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "once", "--nnodes", "1",
            "--nproc-per-node", "1", "--no-status", "--state-dir", str(tmp_path / "state"),
            str(script)]
    code, output, _ = run(argv)
    assert code == 0 and "worker ran" in output, output
    code, output, _ = run(argv)
    lines = [x for x in output.strip().splitlines() if x.startswith("chameleon-run:")]
    assert code == 1 and "worker ran" not in output and "Traceback" not in output, output
    assert lines[-1] == (f"chameleon-run: the rendezvous 'once' at {etcd_server.endpoint} is "
                         "closed: a job with this --rdzv-id already ended there (a job closes "
                         "its rendezvous when it ends, as torchrun's does); start the job with "
                         "a new --rdzv-id"), output
    # the refused run's record in the state dir ends too, with the reason
    events = [json.loads(x) for x in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-2:] == ["agent_started", "job_finished"], events
    assert events[-1]["state"] == "FAILED" and "RendezvousClosedError" in events[-1]["reason"]
