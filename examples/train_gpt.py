"""Train a small byte-level GPT under whatever plan the launcher chose.

    chameleon-run --standalone --nproc-per-node 4 --preset tiny-cpu examples/train_gpt.py
    chameleon-run --standalone --nproc-per-node 4 --job job.toml examples/train_gpt.py --steps 50
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py   # plain data parallel

Under ``chameleon-run --job`` a lost device costs no progress: the surviving processes regroup
in place under the new plan, take the layers they lack (weights and optimizer state) from their
peers and go on at the first step that was not committed everywhere; every step is printed once.
With ``--checkpoint-dir`` the weights and optimizer state are also saved every
``--checkpoint-every`` steps, in the background, as torch.distributed.checkpoint directories
keyed by parameter names, and loaded at start, whatever plan wrote them; they are used when no
live process holds some layer any more, or when the workers are relaunched.

The model is a list of layers, which is all the runtime needs to cut it into pipeline stages:
layer 0 embeds bytes and positions, layers 1..N are pre-norm transformer blocks, the last layer
is the final norm and the byte head; so ``--blocks N`` gives N + 2 layers (the job's
``model.layers`` must match; by default N is taken from the plan). It trains as large models
are trained: the head reuses the byte embedding (tied weights, wherever the two layers sit),
bf16 autocast over fp32 master weights, the gradient norm clipped to 1 over the whole model,
and AdamW under a linear warm-up then cosine decay; each is a flag. The corpus is the Python
standard library's own source, present on every machine that runs this script, cut into
windows of ``--context`` bytes: a map-style dataset, which the runtime reads in shuffled epochs
(each a permutation drawn from the seed and the epoch) one step ahead in the background, so
which text a step trains on depends only on the step number, never on the plan or the number of
workers, and every window is trained once per epoch. The last ``--eval-samples`` windows are
held out: with ``--eval-every K`` their mean loss is computed under the plan in force after
every K steps and after the last one, and printed as ``eval step N loss X``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from chameleon_elastic.runtime import (
    PRECISIONS,
    Every,
    PipelineModel,
    PipelineRuntimeError,
    PipelineTrainer,
    StepResult,
    Tie,
    init_distributed,
    plan_from_env,
)
from chameleon_elastic.runtime.schedules import warmup_cosine

VOCAB = 256

def say(text: str) -> None:
    """One line in one write: two workers sharing the terminal must not glue their lines
    (print writes the text and its newline apart when output is unbuffered)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()



def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's .py files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 4096:
        raise SystemExit(f"found only {len(blob)} bytes of Python source under {root}; "
                         "this example needs the standard library's .py files.")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int64)


class Windows(torch.utils.data.Dataset):
    """The corpus cut into windows of ``context`` bytes: item ``i`` is (window ``i``, the
    same window shifted by one byte), the next-byte targets."""

    def __init__(self, corpus: torch.Tensor, context: int) -> None:
        self.corpus, self.context = corpus, context

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.context
        chunk = self.corpus[start:start + self.context + 1]
        return chunk[:-1], chunk[1:]


def split_corpus(corpus: torch.Tensor, context: int,
                 held_out: int) -> tuple[Windows, Windows]:
    """(training windows, the last ``held_out`` windows), which training never reads."""
    cut = corpus.numel() - held_out * context - 1
    if held_out < 1 or cut < 2 * context:
        raise SystemExit(f"--eval-samples {held_out} leaves no training text in a corpus of "
                         f"{corpus.numel()} bytes; pass fewer, or more --corpus-bytes.")
    return Windows(corpus[:cut], context), Windows(corpus[cut:], context)


class Embed(nn.Module):
    def __init__(self, context: int, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)
        # GPT-2's scale: the head reuses these weights, and N(0, 1) logits would start far
        # from the uniform guess
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        return self.dropout(self.tokens(x) + self.positions(pos))


class Block(nn.Module):
    """Pre-norm attention and MLP. Written for tensor parallelism too: under ``--tp`` the q, k,
    v projections and the MLP's first layer are split by columns (whole heads per card), the
    output projections by rows, so the head count is read from the local width."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.dropout = nn.Dropout(dropout)   # on each residual branch, as GPT-2
        self.norm1 = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (z(h) for z in (self.q, self.k, self.v))
        local = q.shape[-1]   # the whole width, or this card's heads under tensor parallelism
        q, k, v = (z.view(b, t, local // self.head_dim, self.head_dim).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, local)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_layer(i: int, blocks: int, context: int, width: int, heads: int,
                dropout: float = 0.0) -> nn.Module:
    if i == 0:
        return Embed(context, width, dropout)
    if i == blocks + 1:
        return Head(width)
    return Block(width, heads, dropout)


def tensor_parallel_plan(i: int, blocks: int) -> dict:
    """How layer ``i`` is split over a unit of cards (``training.tp`` > 1), Megatron's way:
    the byte embedding by rows of its vocabulary, the head by the same rows (the tie stays
    shard to shard) gathering its logits, each block's attention by heads and MLP by columns
    then rows. The position embedding and the norms are replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if i == 0:
        return {"tokens": RowwiseParallel(input_layouts=Replicate())}
    if i == blocks + 1:
        return {"out": ColwiseParallel(output_layouts=Replicate())}
    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "proj": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}


def byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def gpt_model(blocks: int, context: int, width: int, heads: int, lr: float,
              corpus: torch.Tensor, seed: int, *, tie: bool = True, warmup: int = 0,
              total_steps: int = 0, dataset: torch.utils.data.Dataset | None = None,
              dropout: float = 0.0) -> PipelineModel:
    """The GPT as the runtime's layers, trained on ``dataset`` (default: all of ``corpus``
    in windows)."""
    return PipelineModel(
        num_layers=blocks + 2,
        build_layer=functools.partial(build_layer, blocks=blocks, context=context, width=width,
                                      heads=heads, dropout=dropout),
        loss=byte_loss,
        make_optimizer=functools.partial(adamw, lr=lr),
        dataset=dataset if dataset is not None else Windows(corpus, context),
        seed=seed,
        make_scheduler=(functools.partial(warmup_cosine, warmup=warmup, total=total_steps)
                        if total_steps else None),
        tied=(Tie(((0, "tokens.weight"), (blocks + 1, "out.weight"))),) if tie else (),
        tp_plan=functools.partial(tensor_parallel_plan, blocks=blocks),
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Byte-level GPT on the Python standard library, "
                                             "trained under a chameleon-run plan.")
    ap.add_argument("--steps", type=int, default=30,
                    help="train steps 0 .. STEPS-1 (a resumed run continues from its "
                         "checkpoint). The cosine decay is defined over STEPS, so raising it "
                         "on resume stretches the schedule: the learning rate jumps up at the "
                         "resumed step (keep STEPS, or pass --warmup-steps 0 for a constant "
                         "rate)")
    ap.add_argument("--blocks", type=int, default=None,
                    help="transformer blocks (layers = blocks + 2); default: from the plan, "
                         "else 6")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=5,
                    help="linear warm-up steps before the cosine decay (0: no schedule)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the whole model's gradient norm to this (0: no clipping)")
    ap.add_argument("--precision", choices=PRECISIONS, default=None,
                    help="bf16/fp16: autocast over fp32 master weights (fp16 scales the loss); "
                         "default: the job's training.precision under chameleon-run, else bf16")
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P",
                    help="dropout probability after the embedding and on every residual "
                         "branch (default 0); its masks depend only on (seed, step, "
                         "micro-batch, layer), so every plan trains alike")
    ap.add_argument("--no-tie", action="store_true",
                    help="give the head its own weights instead of reusing the embedding")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per micro-batch; default: the job's training.micro_batch_size "
                         "under chameleon-run (1 unless the job says otherwise; another value is "
                         "refused), else 1, so torchrun and chameleon-run train alike")
    ap.add_argument("--global-micro-batches", type=int, default=8,
                    help="used only without a plan (plain torchrun data parallelism)")
    ap.add_argument("--corpus-bytes", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--checkpoint-dir", default=None,
                    help="save torch.distributed.checkpoint checkpoints here (in the "
                         "background, keyed by parameter names) and resume from the last one, so "
                         "a restart under a new plan (chameleon-run re-plan) goes on training")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=0, metavar="K",
                    help="evaluate the held-out windows under the plan in force after every K "
                         "steps and after the last one, printing 'eval step N loss X' "
                         "(0: never)")
    ap.add_argument("--eval-samples", type=int, default=64,
                    help="windows held out of training at the corpus's end, for --eval-every")
    args = ap.parse_args(argv)
    for name in ("steps", "width", "heads", "context", "global_micro_batches", "corpus_bytes",
                 "log_every", "checkpoint_every", "eval_samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup_steps", "max_grad_norm", "eval_every"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 <= args.dropout < 1:
        ap.error(f"--dropout {args.dropout} must be in [0, 1)")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        ap.error("--micro-batch-size must be >= 1")
    if args.width % args.heads:
        ap.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    if (args.eval_samples + 2) * args.context >= args.corpus_bytes:
        ap.error(f"--eval-samples {args.eval_samples} windows of {args.context} bytes leave no "
                 f"training text in --corpus-bytes {args.corpus_bytes}; hold out fewer")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_from_env()
    blocks = args.blocks if args.blocks is not None else (
        plan.num_layers - 2 if plan is not None else 6)
    if blocks < 1:
        raise SystemExit(f"the plan has {blocks + 2} layers; this GPT needs at least 3 "
                         "(embedding, one block, head): set model.layers >= 3 in the job.")
    tp = int(os.environ.get("CHAMELEON_TP_SIZE", "1"))
    if args.heads % tp or VOCAB % tp:
        raise SystemExit(f"--heads {args.heads} must be a multiple of training.tp = {tp}: "
                         "tensor parallelism gives every card whole attention heads.")
    corpus = stdlib_corpus(args.corpus_bytes)
    train, held_out = split_corpus(corpus, args.context, args.eval_samples)
    init_distributed()
    model = gpt_model(blocks, args.context, args.width, args.heads, args.lr, corpus,
                      args.seed, tie=not args.no_tie, warmup=args.warmup_steps,
                      total_steps=args.steps if args.warmup_steps else 0, dataset=train,
                      dropout=args.dropout)
    try:
        trainer = PipelineTrainer.from_env(model, global_micro_batches=args.global_micro_batches,
                                           micro_batch_size=args.micro_batch_size,
                                           checkpoint_dir=args.checkpoint_dir,
                                           max_grad_norm=args.max_grad_norm or None,
                                           precision=args.precision or os.environ.get(
                                               "CHAMELEON_PRECISION", "bf16"))
    except PipelineRuntimeError as exc:
        raise SystemExit(str(exc)) from None
    where = ("spare" if not trainer.working else
             f"pipeline {trainer.plan.locate(trainer.device)[0]} layers "
             f"{trainer.layer_ids[0]}-{trainer.layer_ids[-1]}")
    unit = f" (a unit of {tp} cards)" if tp > 1 else ""
    if trainer.tp_rank == 0:   # one line per device, not per card
        say(f"[rank {dist.get_rank()}] device {trainer.device}{unit}: {where}; plan "
            f"generation {trainer.plan.generation} ({trainer.plan.policy})")
    first = trainer.committed
    if trainer.is_reporter and first:
        origin = "the checkpoint" if trainer.started_from == "checkpoint" else "its peers"
        say(f"resumed from {origin} after step {first - 1}")
    started = time.perf_counter()

    def report(result: StepResult) -> None:
        step = result.step
        if step % args.log_every == 0 or step == args.steps - 1 or result.redone:
            again = "  (trained again)" if result.redone else ""   # the recovery line says why
            say(f"step {step:4d}  loss {result.loss:.4f}  (bits/byte "
                f"{result.loss / math.log(2):.3f})  lr {result.lr:.2e}  |g| "
                f"{result.grad_norm:.2f}  {result.step_s * 1e3:.0f} ms{again}")
        if not math.isnan(result.eval_loss):
            say(f"eval step {step} loss {result.eval_loss:.4f}")

    try:
        trainer.run(args.steps, report, checkpoint_every=args.checkpoint_every,
                    evaluate=Every(args.eval_every, held_out) if args.eval_every else None)
    except PipelineRuntimeError as exc:
        raise SystemExit(f"rank {dist.get_rank()}: {exc}") from None
    if trainer.is_reporter:
        if first >= args.steps:
            say(f"nothing to train: the checkpoint in {args.checkpoint_dir} already holds "
                f"all {args.steps} steps (raise --steps to train on, or pass another "
                "--checkpoint-dir to start afresh)")
        else:
            say(f"done: steps {first}..{args.steps - 1} in "
                f"{time.perf_counter() - started:.1f} s")
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
