"""A float64 MLP trained under chameleon-run through ``trainer.run``, with faults injected at
chosen phases of chosen steps: the commit protocol's test bed.

    mlp_faults.py OUT STEPS [DEVICE:STEP:PHASE:ACTION ...] [--checkpoint-dir DIR] [--pace S]
                  [--min-world N]

PHASE is one of the trainer's phases (forward, backward, sync, vote, apply, applied, or
enter: as the process starts entering a plan, STEP being the steps it has committed),
``reported``: right after the reporting process wrote step STEP's line, or ``closed``: after
the process closed its trainer at the end (STEP: the run's steps). ACTION:
``kill`` - the process SIGKILLs itself there (a lost device); ``kill-node`` (after
``reported`` only) - it SIGKILLs its agent, then itself (a node lost); ``lose-vote`` - this rank acts as
if its vote had failed although the vote completed elsewhere (what a rank sees when a dying
peer's last message of the all-reduce never arrives): it abandons the step before applying;
``kill-saved`` - as ``kill``, once the checkpoint being written in the background has been
committed (a loss after the checkpoint is on disk, as a save that took no time would have it);
``raise`` - a bug: the script raises (only in the first process of the device, so the process
that replaces it trains on); ``spin`` - a hang that keeps a core busy; ``spin-S`` - busy for
S seconds, then on (slow work, not a hang); ``sleep`` - a hang
asleep (a deadlock of the script's own: to its agent it looks like a wait for a peer); ``dist-error`` - a
``torch.distributed.DistBackendError`` (what NCCL raises), every time the phase is reached, in
every generation: a failure that keeps coming back; ``stop-S`` - another process SIGSTOPs this
one and SIGCONTs it S seconds later (a device frozen for a while); ``linger-S`` (after
``closed`` only) - the process keeps a core busy S seconds before it exits (a slow teardown).

``--tp-model``: residual MLP blocks with a tensor-parallel plan (``toy.tp_mlp_model``), for jobs
with ``training.tp`` > 1; DEVICE in a fault then names a card (``unit * tp + tp rank``), and so
do the ``pid-<card>`` files.

``--featured``: the model brings what real training does (tied first and last layers, tuples
and dicts between stages, warm-up + cosine schedule, AdamW with parameter groups chosen by
name, dropout 0.1, an EMA of every layer's weights as registered per-layer state) and the
trainer clips the gradient norm to ``FEATURED_CLIP``; still float64. The EMA goes to
``OUT/ema-<device>.pt``.

``--dataset N``: train on a map-style dataset of N samples (``toy.RegressionData``), read in
seeded epochs, instead of ``sample(index)``. ``--eval-every K``: evaluate on
``toy.RegressionData(EVAL_SAMPLES, seed=EVAL_SEED)`` every K steps (``trainer.run``'s
``evaluate``); PHASE ``evaluate`` then names an evaluation (STEP: the steps committed), and
each reported line carries ``eval_loss`` (null when the step was not evaluated).

``--hold-at STEP``: every process waits as it enters the checkpoint phase after STEP steps
(checkpoints every 2 steps) until ``OUT/release`` exists, so that a test can wait for what the
launcher says before the faults that follow.

``--busy-start S``: a process that replaces an earlier one of its device spins S seconds before
it starts. ``--pace S`` makes every step last at least S seconds (a sleep before its forward), so that a
test can act while training runs. ``--min-world N``: a worker started in a smaller world waits
without training until the launcher replaces it (a multi-node test's way around the start-up
window in which one node may begin alone). Writes ``OUT/steps.jsonl`` (one line per reported step, from the reporting process, with
the plan generation it trained in),
``OUT/pid-<device>`` (every pid that ran the device) and, at the end, ``OUT/params-<device>.pt``
(layer -> state dict of the layers it holds).
"""

import faulthandler
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from chameleon_elastic.models.toy import (
    RegressionData,
    WeightEMA,
    featured_model,
    mlp_model,
    tp_mlp_model,
)
from chameleon_elastic.runtime import Every, PeerLost, PipelineTrainer, init_distributed

# a launcher test that times out asks every worker where it is (tests/launcher/conftest.py)
faulthandler.register(signal.SIGUSR2, all_threads=False)

FEATURED_CLIP = 0.08
FEATURED = {"layers": 8, "groups": True, "dropout": 0.1}   # featured_model's arguments
EVAL_SAMPLES, EVAL_SEED = 13, 5


def _until_committed(saving) -> None:
    """Until the save in flight is committed (rank 0 moved ``latest`` to its step), or 30 s.
    This rank's save ending is not enough: rank 0 commits only once its own save has ended,
    and a loss in between (a relaunch kills rank 0 too) leaves the previous checkpoint in
    force: the relaunch then resumed from the checkpoint before (a loaded machine trained
    steps 2-4 again where the test expects step 4 only)."""
    from chameleon_elastic.runtime.state.checkpoint import latest_step

    saving.settle()
    deadline = time.monotonic() + 30
    while (latest_step(saving.directory) or -1) < saving.step and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    args = sys.argv[1:]
    featured, sharded = "--featured" in args, "--tp-model" in args
    args = [a for a in args if a not in ("--featured", "--tp-model")]
    options = {}
    for flag in ("--checkpoint-dir", "--pace", "--min-world", "--busy-start", "--dataset",
                 "--eval-every", "--hold-at"):
        if flag in args:
            i = args.index(flag)
            options[flag] = args[i + 1]
            del args[i:i + 2]
    checkpoint = options.get("--checkpoint-dir")
    pace = float(options.get("--pace", 0))
    out, steps, faults = args[0], int(args[1]), args[2:]
    if int(os.environ["WORLD_SIZE"]) < int(options.get("--min-world", 0)):
        time.sleep(3600)   # stopped by the launcher when the other node arrives
    unit = int(os.environ["CHAMELEON_DEVICE"])
    tp_rank, tp = (int(os.environ.get(k, d)) for k, d in (("CHAMELEON_TP_RANK", "0"),
                                                           ("CHAMELEON_TP_SIZE", "1")))
    device = unit * tp + tp_rank   # the card (the device itself without tensor parallelism)
    replacement = os.path.exists(os.path.join(out, f"pid-{device}"))
    with open(os.path.join(out, f"pid-{device}"), "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if replacement:   # a slow start that burns a core, as heavy imports on a busy machine do
        until = time.monotonic() + float(options.get("--busy-start", 0))
        while time.monotonic() < until:
            pass
    mine = {}
    for spec in faults:
        d, step, phase, action = spec.split(":")
        if int(d) == device:
            mine[(int(step), phase)] = action

    trainers = []   # the trainer, once built (kill-saved looks at its save in flight)

    hold_at = int(options.get("--hold-at", -1))

    def on_phase(step: int, phase: str) -> None:
        if pace and phase == "forward":
            time.sleep(pace)
        if (step, phase) == (hold_at, "checkpoint"):
            while not os.path.exists(os.path.join(out, "release")):
                time.sleep(0.05)
        action = mine.get((step, phase))
        if action != "dist-error":
            mine.pop((step, phase), None)
        if action == "kill-saved" and trainers[0].saving is not None:
            _until_committed(trainers[0].saving)
        if action in ("kill", "kill-saved"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "lose-vote":
            raise PeerLost("injected: this rank's vote result was lost")
        elif action == "raise" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise ValueError("injected: a bug in the training script")
        elif action == "dist-error":
            raise torch.distributed.DistBackendError("injected: NCCL communicator was aborted")
        elif action is not None and action.startswith("stop-"):
            pid, seconds = os.getpid(), float(action.split("-")[1])
            subprocess.Popen(["sh", "-c", f"kill -STOP {pid}; sleep {seconds}; kill -CONT {pid}"])
        elif action == "spin":
            while True:   # a hang that burns a core (a stuck kernel polling, a livelock)
                pass
        elif action is not None and action.startswith("spin-"):
            until = time.monotonic() + float(action.split("-")[1])
            while time.monotonic() < until:   # slow, busy: a long stretch of work
                pass
        elif action == "sleep":
            threading.Event().wait()   # a deadlock asleep: nothing it waits for will come

    def report(result) -> None:
        with open(os.path.join(out, "steps.jsonl"), "a") as fh:
            fh.write(json.dumps({"step": result.step, "loss": result.loss,
                                 "redone": result.redone, "device": device,
                                 "generation": trainers[0].plan.generation,
                                 "eval_loss": None if math.isnan(result.eval_loss)
                                 else result.eval_loss}) + "\n")
        action = mine.pop((result.step, "reported"), None)
        if action == "kill-node":   # the agent first: the whole node goes, its word with it
            os.kill(os.getppid(), signal.SIGKILL)
        if action in ("kill", "kill-node"):
            os.kill(os.getpid(), signal.SIGKILL)

    init_distributed()
    dataset = (RegressionData(int(options["--dataset"])) if "--dataset" in options
               else None)
    model = (featured_model(**FEATURED) if featured else tp_mlp_model(layers=8) if sharded
             else mlp_model(layers=8, dataset=dataset))
    every = (Every(int(options["--eval-every"]), RegressionData(EVAL_SAMPLES, seed=EVAL_SEED))
             if "--eval-every" in options else None)
    trainer = PipelineTrainer.from_env(model, on_phase=on_phase, checkpoint_dir=checkpoint,
                                       max_grad_norm=FEATURED_CLIP if featured else None,
                                       layer_state={"ema": WeightEMA} if featured else None)
    trainers.append(trainer)
    with open(os.path.join(out, f"started-{device}"), "a") as fh:   # where its state came from
        fh.write(f"{trainer.started_from}\n")
    trainer.run(steps, report, checkpoint_every=2 if checkpoint else 0, evaluate=every)
    state = trainer.state()   # whole tensors: every card of a unit takes part
    if tp_rank == 0:
        torch.save(state, os.path.join(out, f"params-{unit}.pt"))
    if featured:
        torch.save({layer: objects["ema"].state_dict() for layer, objects
                    in trainer.extras.items()}, os.path.join(out, f"ema-{unit}.pt"))
    trainer.close()
    action = mine.get((steps, "closed"))
    if action is not None and action.startswith("linger-"):   # a slow teardown, on a core
        print(f"device {device} closed its trainer", flush=True)
        until = time.monotonic() + float(action.split("-")[1])
        while time.monotonic() < until:
            pass


if __name__ == "__main__":
    main()
