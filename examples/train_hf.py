"""Train a Hugging Face causal LM under whatever plan the launcher chose, and save it back.

    python examples/train_hf.py --model DIR --steps 20 --export out     # one process
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --model DIR   # plain DP
    chameleon-job hf DIR --devices 4 -o job.toml
    chameleon-run --standalone --nproc-per-node 4 --job job.toml examples/train_hf.py --model DIR

``DIR`` is a directory written by transformers' ``save_pretrained`` (Llama, Mistral, Qwen2,
Qwen3 or GPT-2 families); ``--config NAME`` starts a tiny random model instead. Each process
builds and reads only the layers of its stage (``chameleon_elastic.models.hf.causal_lm``).
Under ``chameleon-run --job`` a lost device costs no progress: the survivors regroup in place,
take the layers they lack from their peers and go on at the first step not committed
everywhere; every step is printed once. ``--export OUT`` writes the trained model in
transformers' format from whatever plan is in force (every process takes part).

It trains as LLMs are trained: AdamW without weight decay on norms and biases (chosen by
transformers' parameter names, which the optimizer receives), a linear
warm-up then cosine decay, the gradient norm clipped to 1 over the whole model, bf16 autocast
over fp32 master weights (``--precision fp32`` makes losses comparable across launchers to the
4th decimal; under chameleon-run the default is the job's precision). The text comes from
``--data FILE...`` or, by default, the Python standard library's own source, tokenized with
DIR's tokenizer when it has one and as bytes otherwise, and cut into windows of ``--context``
tokens: a map-style dataset (``hf.TokenWindows``) that the runtime reads in shuffled epochs,
one step ahead in the background, so which text a step trains on depends only on the step
number, never on the plan, and every window is trained once per epoch. The last
``--eval-samples`` windows are held out: with ``--eval-every K`` their mean loss is computed
under the plan in force after every K steps and after the last one, and printed as
``eval step N loss X``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

from chameleon_elastic.models import hf
from chameleon_elastic.runtime import (
    PRECISIONS,
    Every,
    PipelineModel,
    PipelineRuntimeError,
    PipelineTrainer,
    StepResult,
    init_distributed,
    plan_from_env,
)
from chameleon_elastic.runtime.schedules import warmup_cosine

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def say(text: str) -> None:
    """One line in one write: two workers sharing the terminal must not glue their lines
    (print writes the text and its newline apart when output is unbuffered)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def read_text(files: list[str], max_bytes: int) -> str:
    """The first ``max_bytes`` of ``files``, or of the standard library's .py files in sorted
    path order (present on every machine that runs this script)."""
    paths = [Path(f) for f in files] if files else sorted(
        Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chunks, total = [], 0
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise hf.HFModelError(f"cannot read --data file {str(path)!r} "
                                  f"({exc.strerror}); pass readable text files.") from None
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes].decode("utf-8", errors="replace")


def tokenize(text: str, directory: Path | None, vocab: int) -> tuple[torch.Tensor, str]:
    """Token ids of ``text`` with the model's tokenizer when ``directory`` has one, else its
    UTF-8 bytes (which need a vocabulary of at least 256)."""
    if directory is not None and any((directory / f).is_file() for f in
                                     ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64), "the model's tokenizer"
    if vocab < 256:
        raise hf.HFModelError(f"the model's vocabulary has {vocab} tokens and its directory no "
                              "tokenizer; byte-level text needs at least 256, so save the "
                              "tokenizer beside the model.")
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    return data.to(torch.int64), "bytes"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train a Hugging Face causal LM under a "
                                             "chameleon-run plan, and save it back.")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR",
                        help="a directory written by transformers' save_pretrained")
    source.add_argument("--config", metavar="NAME", choices=sorted(hf.TINY),
                        help="a tiny random model instead: " + ", ".join(sorted(hf.TINY)))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=None,
                    help="with --config: decoder layers (default: from the plan, else 2)")
    ap.add_argument("--context", type=int, default=128, help="tokens per sample")
    ap.add_argument("--data", nargs="+", metavar="FILE", default=[],
                    help="text files to train on (default: the Python standard library)")
    ap.add_argument("--data-bytes", type=int, default=2_000_000,
                    help="read at most this many bytes of text")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--weight-decay", type=float, default=0.1,
                    help="AdamW weight decay (none on norms and biases, told apart by "
                         "transformers' parameter names)")
    ap.add_argument("--warmup-steps", type=int, default=5,
                    help="linear warm-up steps before the cosine decay (0: no schedule)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the whole model's gradient norm to this (0: no clipping)")
    ap.add_argument("--precision", choices=PRECISIONS, default=None,
                    help="bf16/fp16: autocast over fp32 master weights; default: the job's "
                         "training.precision under chameleon-run, else bf16")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="master weights (float64: exact comparisons in tests)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="every dropout probability of the model (default 0); its masks depend "
                         "only on (seed, step, micro-batch, layer), so every plan trains alike")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per micro-batch; default: the job's under chameleon-run "
                         "(another value is refused), else 4")
    ap.add_argument("--global-micro-batches", type=int, default=8,
                    help="used only without a plan (one process, plain torchrun)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--losses", metavar="FILE", default=None,
                    help="also append every reported step as a JSON line (full precision)")
    ap.add_argument("--pace", type=float, default=0.0,
                    help="make each step last at least this many seconds (time to kill -9 "
                         "a worker by hand in a demo)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="save torch.distributed.checkpoint checkpoints here (in the "
                         "background, keyed by transformers' names) and resume from the last one")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=0, metavar="K",
                    help="evaluate the held-out windows under the plan in force after every K "
                         "steps and after the last one, printing 'eval step N loss X' "
                         "(0: never)")
    ap.add_argument("--eval-samples", type=int, default=16,
                    help="windows held out of training at the text's end, for --eval-every")
    ap.add_argument("--export", metavar="OUT", default=None,
                    help="at the end, save the model where transformers' from_pretrained "
                         "loads it")
    args = ap.parse_args(argv)
    for name in ("steps", "context", "global_micro_batches", "data_bytes", "log_every",
                 "checkpoint_every", "eval_samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup_steps", "max_grad_norm", "pace", "weight_decay", "dropout",
                 "eval_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("micro_batch_size", "layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def alone() -> None:
    """One process without a launcher: a world of one on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")


def split(tokens: torch.Tensor, context: int,
          held_out: int) -> tuple[hf.TokenWindows, hf.TokenWindows]:
    """(training windows, the last ``held_out`` windows), which training never reads."""
    cut = tokens.numel() - held_out * context
    if cut < context:
        raise hf.HFModelError(f"--eval-samples {held_out} leaves no training text in "
                              f"{tokens.numel()} tokens; pass fewer, or more --data-bytes.")
    return hf.TokenWindows(tokens[:cut], context), hf.TokenWindows(tokens[cut:], context)


def build(args: argparse.Namespace, plan) -> tuple[PipelineModel, hf.TokenWindows, str]:
    """The model, with its training data; the held-out windows; how the text was
    tokenized."""
    if args.config:
        layers = args.layers or (plan.num_layers - 2 if plan is not None else 2)
        source = hf.tiny_config(args.config, layers=max(layers, 1))
        directory = None
    else:
        source = directory = Path(args.model)
    config, _ = hf.load_config(source)
    vocab = int(config.get_text_config().vocab_size)
    tokens, how = tokenize(read_text(args.data, args.data_bytes), directory, vocab)
    train, held_out = split(tokens, args.context, args.eval_samples)
    model = hf.causal_lm(
        source,
        dataset=train,
        make_optimizer=functools.partial(hf.adamw, lr=args.lr, weight_decay=args.weight_decay),
        make_scheduler=(functools.partial(warmup_cosine, warmup=args.warmup_steps, total=args.steps)
                        if args.warmup_steps else None),
        seed=args.seed, dtype=DTYPES[args.dtype], dropout=args.dropout)
    return model, held_out, how


def fail(message: str) -> int:
    """A setup error: one line on stderr, exit status 2."""
    print(f"train_hf.py: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_from_env()
    try:
        hf.require_extra("examples/train_hf.py")
        model, held_out, tokenized = build(args, plan)
    except hf.HFModelError as exc:
        return fail(str(exc))
    alone()
    init_distributed()
    pace = args.pace

    def on_phase(step: int, phase: str) -> None:
        if pace and phase == "forward":
            time.sleep(pace)

    try:
        trainer = PipelineTrainer.from_env(
            model, global_micro_batches=args.global_micro_batches,
            micro_batch_size=args.micro_batch_size or (None if plan is not None else 4),
            checkpoint_dir=args.checkpoint_dir, max_grad_norm=args.max_grad_norm or None,
            precision=args.precision or (None if plan is not None else "bf16"),
            on_phase=on_phase if pace else None)
    except (PipelineRuntimeError, hf.HFModelError) as exc:
        return fail(str(exc))
    weights = (f"weights from {args.model}" if hf.layers_of(model).pretrained
               else "random weights")
    where = ("spare" if not trainer.working else
             f"pipeline {trainer.plan.locate(trainer.device)[0]} layers "
             f"{trainer.layer_ids[0]}-{trainer.layer_ids[-1]}")
    if trainer.tp_rank == 0:
        say(f"[rank {dist.get_rank()}] device {trainer.device}: {where} of "
            f"{model.num_layers}; plan generation {trainer.plan.generation} "
            f"({trainer.plan.policy}); {weights}; text as {tokenized}; {trainer.precision}")
    first = trainer.committed
    if trainer.is_reporter and first:
        origin = "the checkpoint" if trainer.started_from == "checkpoint" else "its peers"
        say(f"resumed from {origin} after step {first - 1}")
    started = time.perf_counter()

    def report(result: StepResult) -> None:
        step = result.step
        evaluated = not math.isnan(result.eval_loss)
        if args.losses:
            with open(args.losses, "a") as fh:
                fh.write(json.dumps({"step": step, "loss": result.loss, "lr": result.lr,
                                     "step_s": result.step_s, "compute_s": result.compute_s,
                                     "sync_s": result.sync_s, "redone": result.redone,
                                     "eval_loss": result.eval_loss if evaluated else None,
                                     "pid": os.getpid(), "time": time.time()}) + "\n")
        if step % args.log_every == 0 or step == args.steps - 1 or result.redone:
            again = "  (trained again)" if result.redone else ""
            say(f"step {step:4d}  loss {result.loss:.4f}  lr {result.lr:.2e}  |g| "
                f"{result.grad_norm:.2f}  {result.step_s * 1e3:.0f} ms{again}")
        if evaluated:
            say(f"eval step {step} loss {result.eval_loss:.4f}")

    try:
        trainer.run(args.steps, report, checkpoint_every=args.checkpoint_every,
                    evaluate=Every(args.eval_every, held_out) if args.eval_every else None)
        if args.export:
            hf.save_pretrained(trainer, args.export)
    except PipelineRuntimeError as exc:
        raise SystemExit(f"rank {dist.get_rank()}: {exc}") from None
    if trainer.is_reporter:
        say(f"done: steps {first}..{args.steps - 1} in "
            f"{time.perf_counter() - started:.1f} s"
            + (f"; saved to {args.export}" if args.export else ""))
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
