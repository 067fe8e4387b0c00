"""``python -m chameleon_elastic.rendezvous.dev_etcd``: an etcd on loopback for development.

One member (:class:`~.local_etcd.LocalEtcd`) or a cluster (``--members N``,
:class:`~.local_cluster.LocalEtcdCluster`), on free ports unless told, until Ctrl-C or SIGTERM;
it prints the ``--rdzv-endpoint`` to pass to ``chameleon-run``. A module of its own because it
starts either: the two classes stay one-way (a cluster is made of single members).
"""

from __future__ import annotations

import argparse
import signal
import sys

from chameleon_elastic.rendezvous.errors import EtcdServerError
from chameleon_elastic.rendezvous.local_cluster import LocalEtcdCluster
from chameleon_elastic.rendezvous.local_etcd import LocalEtcd

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m chameleon_elastic.rendezvous.dev_etcd``: a dev etcd until Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m chameleon_elastic.rendezvous.dev_etcd",
        description="Run an etcd on 127.0.0.1 for development (one member, or a cluster with "
        "--members); prints the --rdzv-endpoint to use and runs until interrupted (Ctrl-C or "
        "SIGTERM).",
    )
    parser.add_argument("--data-dir", help="keep data here (default: a temporary directory)")
    parser.add_argument("--port", type=int, help="client port (default: a free one)")
    parser.add_argument("--members", type=int, default=1,
                        help="cluster members, each on free ports (default: 1)")
    args = parser.parse_args(argv)
    if args.port is not None and not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port (1..65535)")
    if args.members < 1:
        parser.error(f"--members {args.members}: a cluster needs at least 1 member")
    if args.members > 1 and args.port is not None:
        parser.error("--port applies to one member; drop it with --members (free ports are used)")
    server: LocalEtcd | LocalEtcdCluster
    if args.members == 1:
        server = LocalEtcd(data_dir=args.data_dir, client_port=args.port)
    else:
        server = LocalEtcdCluster(args.members, work_dir=args.data_dir)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        server.start()
        if isinstance(server, LocalEtcd):
            ready = f"--rdzv-endpoint {server.endpoint} (data: {server.data_dir})"
        else:
            ready = f"--rdzv-endpoint {server.endpoints} (data: {server.work_dir})"
        print(f"etcd ready: {ready}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except EtcdServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
