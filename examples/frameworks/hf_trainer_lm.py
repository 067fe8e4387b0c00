"""A Hugging Face ``Trainer`` script that follows chameleon-run's plan (one line: its arguments').

    python examples/frameworks/hf_trainer_lm.py OUT --accumulate 4      # one process
    torchrun --standalone --nproc-per-node 2 examples/frameworks/hf_trainer_lm.py OUT --accumulate 2
    chameleon-run --standalone --nproc-per-node 2 --job job.toml \\
        examples/frameworks/hf_trainer_lm.py OUT

The line that follows the plan is ``TrainingArguments(**hf_trainer.training_args(...), ...)``:
under ``--job`` it gives the ``Trainer`` the job's micro-batch size and the plan's accumulation;
elsewhere it hands back the script's own ``--micro-batch-size`` and ``--accumulate``.

A tiny Llama, built from a config (nothing is downloaded), learns token sequences that count
up by a fixed stride (mod the vocabulary), in float32 with AdamW. The ``Trainer`` shuffles the
sequences with one seeded permutation per epoch (accelerate's seedable sampler) and deals its
micro-batches out to the ranks in turn, so a step covers the same sequences whatever the world.
A checkpoint is saved after every step; a relaunch resumes from the newest complete one
(``hf_trainer.last_checkpoint``), and the ``Trainer`` skips the batches of the resumed epoch
already trained, counted in the new plan's micro-batches.

Rank 0 appends one JSON line per optimizer step to ``OUT/steps.jsonl``: the step, the
``Trainer``'s logged loss (the mean over every token of the global batch), and the rank, world
size, accumulation, plan generation and process id it was trained under.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from chameleon_elastic.frameworks import hf_trainer

VOCAB, LENGTH = 64, 16


class Counting(torch.utils.data.Dataset):
    """``samples`` sequences ``start, start + stride, ...`` (mod VOCAB), the same everywhere."""

    def __init__(self, samples: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        start = torch.randint(0, VOCAB, (samples, 1), generator=gen)
        stride = torch.randint(1, 4, (samples, 1), generator=gen)
        self.ids = (start + stride * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepLog(TrainerCallback):
    """Rank 0 writes each step's logged loss; ``--hold-after-step K`` makes it wait after step
    K of the first plan for good, as a stuck worker would (tests kill it there)."""

    def __init__(self, out: Path, hold_after: int | None) -> None:
        self.out, self.hold_after = out, hold_after

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        step = state.global_step - 1
        record = {"step": step, "loss": logs["loss"], "rank": args.process_index,
                  "world_size": args.world_size, "accumulation": args.gradient_accumulation_steps,
                  "generation": int(os.environ.get("CHAMELEON_PLAN_GENERATION", "-1")),
                  "pid": os.getpid()}
        with open(self.out / "steps.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if step == self.hold_after and os.environ.get("CHAMELEON_PLAN_GENERATION", "0") == "0":
            while True:
                time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--hold-after-step", type=int, default=None,
                        help="tests: rank 0 waits after this step of the first plan, to be killed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH))
    checkpoints = args.out / "checkpoints"
    training = TrainingArguments(
        **hf_trainer.training_args(per_device_train_batch_size=args.micro_batch_size,
                                   gradient_accumulation_steps=args.accumulate),
        output_dir=str(checkpoints), max_steps=args.steps, learning_rate=3e-3, seed=0,
        lr_scheduler_type="constant", logging_steps=1, save_steps=1, save_total_limit=2,
        report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=training, train_dataset=Counting(args.samples),
                      callbacks=[StepLog(args.out, args.hold_after_step)])
    trainer.train(resume_from_checkpoint=hf_trainer.last_checkpoint(checkpoints))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # gloo's threads outlive the process group: skip the teardown (ddp_torchrun.py)
