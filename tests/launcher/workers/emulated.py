"""A runtime script whose layers take their time by sleeping (``toy.emulated_model``, float64):
a slowed process slows only its own device, as a throttled accelerator would.

    emulated.py OUT STEPS [--forward-ms F]

Each layer's forward sleeps F ms (default 5) and its backward 2F. Writes ``OUT/steps.jsonl``
(one line per reported step: its loss and the wall time it was reported at) and
``OUT/pid-<device>`` (every pid that ran the device), so that a test or a benchmark can slow a
device from outside (SIGSTOP/SIGCONT) and measure the job's throughput.
"""

import faulthandler
import json
import os
import signal
import sys
import time

import torch

from chameleon_elastic.models.toy import emulated_model
from chameleon_elastic.runtime import PipelineTrainer, init_distributed

# a launcher test that times out asks every worker where it is (tests/launcher/conftest.py)
faulthandler.register(signal.SIGUSR2, all_threads=False)

LAYERS = 8


def main() -> None:
    args = sys.argv[1:]
    forward_ms = 5.0
    if "--forward-ms" in args:
        i = args.index("--forward-ms")
        forward_ms = float(args[i + 1])
        del args[i:i + 2]
    out, steps = args[0], int(args[1])
    device = int(os.environ["CHAMELEON_DEVICE"])
    with open(os.path.join(out, f"pid-{device}"), "a") as fh:
        fh.write(f"{os.getpid()}\n")

    def report(result) -> None:
        with open(os.path.join(out, "steps.jsonl"), "a") as fh:
            fh.write(json.dumps({"step": result.step, "loss": result.loss,
                                 "time": time.time()}) + "\n")

    init_distributed()
    model = emulated_model(LAYERS, forward_ms / 1e3, 2 * forward_ms / 1e3, dtype=torch.float64)
    trainer = PipelineTrainer.from_env(model)
    trainer.run(steps, report)
    trainer.close()


if __name__ == "__main__":
    main()
