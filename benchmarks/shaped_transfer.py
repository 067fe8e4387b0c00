"""The paper's weight-transfer ablation on shaped links: the restorer's minimum-transfer
assignment vs a naive one, as recovery time, at 4, 8 and 16 layers.

The paper (8 devices, DP=4 x PP=2, 16 layers) reports transfer -32.35% and recovery 11.2 s ->
8.2 s (-26.79%) with its assignment. On one host every transfer crosses loopback (gigabytes a
second), so the difference could not show. Here each surviving device is a process in a
network namespace of its own, on a link of ``--rate-mbit`` each way (rendezvous/local_hosts.py
``Link``: tc HTB on both ends of its veth), so moving a layer costs what it would between
hosts.

Scenario (per layer count): the job runs DP=4 x PP=2 on devices 0-7 (layers split evenly
between the two stages; ``--dp``); device 3 is lost (``--lost``); the planner re-plans (``policy="replan"``) for the
seven left. Both modes take the planner's layout (its pipelines and their layer ranges) and
differ only in who takes which slot and who sends each missing layer:

- ``restorer``: the planner's own placement (``planning.restorer.place``: the assignment that
  moves the fewest bytes, each layer's sender chosen for the busiest link);
- ``naive``: the live devices in id order onto the slots in order (pipeline by pipeline, stage
  by stage), each missing layer from its lowest-id holder.

Each survivor holds its stage's layers as real modules (``nn.Linear(--hidden, --hidden)``) with
Adam state after one step, and runs what an in-place recovery runs after the decision: it
forms the new world (gloo ``init_process_group`` over the shaped links), moves its layers with
the runtime's own ``migrate.move_layers`` and meets the others at a barrier. Reported, the
slowest rank's: regroup (the start -> every rank formed), transfer (-> every move done) and
recovery (-> the barrier). The modes alternate within each trial; the table gives medians and
the restorer's time as a fraction of the naive one's. Needs root, ``ip netns`` and tc's HTB.

    python benchmarks/shaped_transfer.py [--layers 4,8,16] [--rate-mbit 200] [--hidden 1024]
        [--trials 3] [--dp 4] [--lost 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

PP = 2


def spec_for(layers: int, hidden: int, dp: int = 4) -> Any:
    """DP=dp x PP=2 with ``layers`` layers of ``nn.Linear(hidden, hidden)``: fp32 parameters,
    and Adam's two moments as the optimizer state."""
    from chameleon_elastic.spec import JobSpec

    base = JobSpec.preset("tiny-cpu")
    params = 4.0 * (hidden * hidden + hidden)
    model = replace(base.model, layers=layers, forward_s=(0.002,) * layers,
                    backward_s=(0.004,) * layers, param_bytes=(params,) * layers,
                    optimizer_bytes=(2 * params,) * layers,
                    activation_bytes=(2e5,) * layers, boundary_bytes=None)
    return replace(base, model=model, cluster=replace(base.cluster, devices=dp * PP),
                   training=replace(base.training, dp=dp, pp=PP, global_micro_batches=4 * dp))


def scenarios(layers: int, hidden: int, dp: int = 4, lost: int = 3) -> dict[str, dict[str, Any]]:
    """Both modes' moves for one layer count: {mode: {held, moves, world, bytes}}."""
    from chameleon_elastic.planning import decide, initial_plan
    from chameleon_elastic.planning.restorer import holdings

    spec = spec_for(layers, hidden, dp)
    plan = initial_plan(spec)
    chosen = decide(spec, plan, failed=[lost], policy="replan").chosen
    live = [d for d in range(dp * PP) if d != lost]
    held = holdings(plan, live)
    restorer_moves = [[int(t.src), t.dst, list(t.layers)] for t in chosen.transfers]
    slots = [(p, s) for p, pipe in enumerate(chosen.pipelines) for s in range(len(pipe.devices))]
    naive_moves: dict[tuple[int, int], list[int]] = {}
    for (p, s), device in zip(slots, live):
        start, end = chosen.pipelines[p].layers[s]
        for layer in range(start, end):
            if not held[device][0] <= layer < held[device][1]:
                source = min(d for d in live if held[d][0] <= layer < held[d][1])
                naive_moves.setdefault((source, device), []).append(layer)
    per_layer = spec.model.transfer_bytes(0)
    out = {}
    for mode, moves in (("restorer", restorer_moves),
                        ("naive", [[s, d, ls] for (s, d), ls in sorted(naive_moves.items())])):
        out[mode] = {"held": {str(d): list(held[d]) for d in live}, "moves": moves,
                     "world": live, "layers_moved": sum(len(m[2]) for m in moves),
                     "bytes": per_layer * sum(len(m[2]) for m in moves)}
    return out


# ---------------------------------------------------------------- one survivor (its namespace)

def worker(device: int, config: str, store_at: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from chameleon_elastic.runtime.state.migrate import Move, move_layers
    from chameleon_elastic.runtime.topology import RankMap

    plan = json.loads(Path(config).read_text())
    host, port = store_at.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=300))
    for i, run in enumerate(plan["runs"]):
        case = run["case"]
        start, end = case["held"][str(device)]
        torch.manual_seed(device)
        layers = {x: nn.Linear(plan["hidden"], plan["hidden"]) for x in range(start, end)}
        params = [p for m in layers.values() for p in m.parameters()]
        optimizer = torch.optim.Adam(params) if params else None
        if optimizer is not None:   # one step: Adam's moments exist and move with the layer
            sum(p.sum() for p in params).backward()
            optimizer.step()
        store.add(f"ready/{i}", 1)
        store.wait([f"go/{i}"])
        began = time.monotonic()
        world = case["world"]
        dist.init_process_group("gloo", store=dist.PrefixStore(f"run/{i}/", store),
                                rank=world.index(device), world_size=len(world),
                                timeout=timedelta(seconds=300))
        formed = time.monotonic()
        moves = [Move(s, d, tuple(ls)) for s, d, ls in case["moves"]]
        received = move_layers(moves, device, RankMap(tuple(world)), layers, optimizer,
                               torch.device("cpu"))
        moved = time.monotonic()
        dist.barrier()
        done = time.monotonic()
        dist.destroy_process_group()
        expected = sum(len(ls) for _, d, ls in case["moves"] if d == device)
        store.set(f"result/{i}/{device}", json.dumps({
            "began": began, "formed": formed, "moved": moved, "done": done,
            "received": len(received), "expected": expected}))
    os._exit(0)


# ---------------------------------------------------------------- the parent

def measure(layer_counts: list[int], rate_mbit: float, hidden: int, trials: int,
            say: Any, dp: int = 4, lost: int = 3) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from chameleon_elastic.rendezvous.local_hosts import Link, LocalHosts

    cases = {n: scenarios(n, hidden, dp, lost) for n in layer_counts}
    runs = [{"layers": n, "mode": mode, "trial": t, "case": cases[n][mode]}
            for t in range(trials) for n in layer_counts
            for mode in (("restorer", "naive") if t % 2 == 0 else ("naive", "restorer"))]
    live = [d for d in range(dp * PP) if d != lost]
    with LocalHosts(len(live), link=Link(rate_mbit)) as hosts, \
            tempfile.TemporaryDirectory(prefix="shaped-") as tmp:
        config = Path(tmp) / "runs.json"
        config.write_text(json.dumps({"hidden": hidden, "runs": runs}))
        store = dist.TCPStore(hosts.bridge_ip, 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=600))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        procs = []
        for device, host in zip(live, hosts.hosts):
            procs.append(subprocess.Popen(
                [*host.wrap(), sys.executable, __file__, "--worker", str(device), "--config",
                 str(config), "--store", f"{hosts.bridge_ip}:{store.port}"],
                env={**env, "GLOO_SOCKET_IFNAME": host.inside}))
        try:
            return [_run(store, i, run, live, procs, say) for i, run in enumerate(runs)]
        finally:
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _run(store: Any, i: int, run: dict[str, Any], live: list[int], procs: list[Any],
         say: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while int(store.add(f"ready/{i}", 0)) < len(live):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"a survivor process died or hung before run {i}")
        time.sleep(0.05)
    store.set(f"go/{i}", "1")
    results = [json.loads(store.get(f"result/{i}/{d}")) for d in live]
    wrong = [r for r in results if r["received"] != r["expected"]]
    if wrong:
        raise RuntimeError(f"run {i}: a survivor received {wrong[0]['received']} layers, "
                           f"expected {wrong[0]['expected']}")
    began = min(r["began"] for r in results)
    formed = max(r["formed"] for r in results)
    row = {"layers": run["layers"], "mode": run["mode"], "trial": run["trial"],
           "layers_moved": run["case"]["layers_moved"], "bytes_moved": run["case"]["bytes"],
           "regroup_s": formed - began,
           "transfer_s": max(r["moved"] for r in results) - formed,
           "recovery_s": max(r["done"] for r in results) - began}
    say(f"  {run['layers']} layers, {run['mode']}, trial {run['trial'] + 1}: "
        f"{row['layers_moved']} layers moved, transfer {row['transfer_s']:.2f} s, "
        f"recovery {row['recovery_s']:.2f} s")
    return row


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (layers, mode), and the restorer's share of the naive time."""
    out = []
    for n in sorted({r["layers"] for r in rows}):
        med = {}
        for mode in ("restorer", "naive"):
            mine = [r for r in rows if r["layers"] == n and r["mode"] == mode]
            med[mode] = {k: statistics.median(r[k] for r in mine)
                         for k in ("regroup_s", "transfer_s", "recovery_s")}
            med[mode]["layers_moved"] = mine[0]["layers_moved"]
            med[mode]["bytes_moved"] = mine[0]["bytes_moved"]
        out.append({"layers": n, **{f"{mode}_{k}": v for mode, m in med.items()
                                    for k, v in m.items()},
                    "transfer_ratio": med["restorer"]["transfer_s"] / med["naive"]["transfer_s"],
                    "recovery_ratio": med["restorer"]["recovery_s"] / med["naive"]["recovery_s"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8,16", help="layer counts (default 4,8,16)")
    parser.add_argument("--rate-mbit", type=float, default=200.0,
                        help="each host's link, megabits a second each way (default 200)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="each layer is nn.Linear(hidden, hidden) (default 1024: 4 MB of "
                             "parameters, 12 MB with Adam's state)")
    parser.add_argument("--trials", type=int, default=3, help="runs of each case (default 3)")
    parser.add_argument("--dp", type=int, default=4,
                        help="data-parallel width, pipelines of 2 stages (default 4: the "
                             "paper's 8 devices; 2 is the suite's quick check)")
    parser.add_argument("--lost", type=int, default=3, help="the device lost (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.config, args.store)
        return 0
    from chameleon_elastic.rendezvous.local_hosts import unavailable

    why = unavailable(shaped=True)
    if why:
        print(f"shaped_transfer.py: cannot shape links here: {why}", file=sys.stderr)
        return 2
    try:
        counts = [int(x) for x in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers {args.layers!r} must be comma-separated integers, e.g. 4,8,16")
    if min(counts) < PP * 2 or args.rate_mbit <= 0 or args.hidden < 1 or args.trials < 1 \
            or args.dp < 2 or not 0 <= args.lost < args.dp * PP:
        parser.error(f"--layers needs at least {PP * 2} layers each, --dp at least 2, --lost "
                     "a device of the job (0 to 2 x dp - 1); --rate-mbit, --hidden and --trials "
                     "must be positive")
    say = (lambda s: print(s, file=sys.stderr, flush=True))
    rows = measure(counts, args.rate_mbit, args.hidden, args.trials, say, args.dp, args.lost)
    summary = table(rows)
    if args.json:
        json.dump({"benchmark": "shaped_transfer", "rate_mbit": args.rate_mbit,
                   "hidden": args.hidden, "dp": args.dp, "lost": args.lost, "rows": rows,
                   "summary": summary}, sys.stdout,
                  indent=2)
        print()
        return 0
    print("layers | layers moved (restorer / naive) | transfer s (restorer / naive) | "
          "restorer/naive | recovery s (restorer / naive) | restorer/naive")
    for s in summary:
        print(f"{s['layers']} | {s['restorer_layers_moved']} / {s['naive_layers_moved']} | "
              f"{s['restorer_transfer_s']:.2f} / {s['naive_transfer_s']:.2f} | "
              f"{s['transfer_ratio']:.2f} | {s['restorer_recovery_s']:.2f} / "
              f"{s['naive_recovery_s']:.2f} | {s['recovery_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
