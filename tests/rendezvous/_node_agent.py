"""One "node" for the agent tests: torchrun's agent plus a lease-backed liveness key.

Usage: _node_agent.py ENDPOINT RUN_ID NODE_ID TTL -- [torchrun arguments]. It registers
NODE_ID with NodeLiveness (what chameleon-run does) and then runs torch's own torchrun main in
the same process, so a SIGKILL of this process stops the lease keep-alives as a node loss would.
"""

from __future__ import annotations

import sys

from torch.distributed.run import main as torchrun_main

from chameleon_elastic.rendezvous.client import EtcdClient
from chameleon_elastic.rendezvous.config import EtcdSettings
from chameleon_elastic.rendezvous.liveness import NodeLiveness


def main() -> None:
    endpoint, run_id, node_id, ttl = sys.argv[1:5]
    assert sys.argv[5] == "--"
    settings = EtcdSettings.from_config(endpoint, {"retry_timeout": "30"})
    client = EtcdClient(settings)
    liveness = NodeLiveness(client, settings.run_prefix(run_id), node_id, ttl=int(ttl)).start()
    try:
        torchrun_main(sys.argv[6:])
    finally:
        liveness.stop()
        client.close()


if __name__ == "__main__":
    main()
