"""Test worker without torch (starts in milliseconds): records its environment, then acts.

Every launch writes ``<out>/env-<pid>.json`` (the environment plus a few facts) before acting.

Modes:
  ok                exit 0
  fail              exit 1 (every rank)
  hold              wait until ``<out>/release`` exists (60 s deadline), then exit 0
  crash-once DEV    device DEV (CHAMELEON_DEVICE, else LOCAL_RANK) exits 1 on its first
                    launch (TORCHELASTIC_RESTART_COUNT == 0); others hold
  crash-n N         rank 0 exits 1 while TORCHELASTIC_RESTART_COUNT < N; others wait for the
                    next launch (they are stopped by the agent) or exit 0 on the last one
  hold-peers        like hold, but exit 1 as soon as a peer of the same launch (same
                    MASTER_PORT) has died: a stand-in for a collective failing on a lost peer
  hold-peers-loud   like hold-peers, saying on stderr that it is up, and, before it exits,
                    a survivor's complaint about its lost peer
  hold-following    like hold, after telling the agent that the script follows the plan's
                    share of the batch (frameworks/share.py; imports torch) and writing
                    ``<out>/announced-<pid>``
"""

import json
import os
import socket
import sys
import time


def store_reachable() -> bool:
    try:
        with socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                                      timeout=5):
            return True
    except OSError:
        return False


def hold(out: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "release")):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)


def peers_alive(out: str) -> bool:
    for name in os.listdir(out):
        if not name.startswith("env-"):
            continue
        try:
            with open(os.path.join(out, name)) as fh:
                peer = json.load(fh)
        except (OSError, ValueError):
            continue
        if peer["env"].get("MASTER_PORT") != os.environ["MASTER_PORT"]:
            continue
        try:
            with open(f"/proc/{peer['pid']}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except OSError:
            return False
    return True


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    record = {"pid": os.getpid(), "ppid": os.getppid(), "time": time.time(),
              "argv": sys.argv[1:], "store_reachable": store_reachable(), "env": dict(os.environ)}
    tmp = os.path.join(out, f".env-{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, os.path.join(out, f"env-{os.getpid()}.json"))

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = int(os.environ.get("CHAMELEON_DEVICE", os.environ["LOCAL_RANK"]))
    if mode == "ok":
        return
    if mode == "fail":
        sys.exit(1)
    if mode == "raise":   # a bug in the script: a traceback on stderr, exit 1
        if device == int(sys.argv[3]):
            raise ValueError(f"probe on device {device} raised on purpose")
        hold(out)
        return
    if mode == "hold":
        hold(out)
        return
    if mode == "hold-following":
        from chameleon_elastic.frameworks.share import PlanShare, announce

        announce(PlanShare.from_env())
        open(os.path.join(out, f"announced-{os.getpid()}"), "w").close()
        hold(out)
        return
    if mode in ("hold-peers", "hold-peers-loud"):
        loud = mode == "hold-peers-loud"
        if loud:
            print(f"probe rank {os.environ['RANK']} is up", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "release")):
            if time.monotonic() > deadline:
                sys.exit(3)
            if not peers_alive(out):
                if loud:
                    print("Traceback (most recent call last):\nRuntimeError: Connection reset "
                          "by peer (a survivor's complaint)", file=sys.stderr, flush=True)
                sys.exit(1)
            time.sleep(0.05)
        return
    if mode == "crash-once":
        if device == int(sys.argv[3]) and restart == 0:
            sys.exit(1)
        hold(out)
        return
    if mode == "crash-n":
        n = int(sys.argv[3])
        if restart < n:
            if os.environ["RANK"] == "0":
                sys.exit(1)
            time.sleep(60)  # stopped by the agent when rank 0 fails
            sys.exit(3)
        return
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
