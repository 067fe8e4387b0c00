"""Saving a trained causal LM in transformers' own format, from a live job or a checkpoint.

From a live job (:func:`save_from_trainer`, collective): every layer is written once, by its
lowest holder (under tensor parallelism the unit gathers its shards, as checkpoints do, and
card 0 writes), one safetensors shard per writing device; rank 0 writes ``config.json``, the
shard index and the tokenizer files of the source directory. Who writes what is a function of
the plan, so the index needs no communication: only a barrier at the end, after which the
directory is whole. A tied head is not stored (transformers ties it back on load).

Offline (:func:`convert`, ``python -m chameleon_elastic.models.hf convert``): a runtime
checkpoint (``step-N/``, torch.distributed.checkpoint keyed by transformers' names), one shard
per layer, read a layer at a time. Both keep the training's master precision (float32, or float64 in tests) and say so in
``config.json``.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .hf_weights import shard_name, write_index, write_shard

__all__ = ["convert", "main", "save_from_trainer"]

#: Files of a source directory that describe the tokenizer and generation, copied as they are.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
               "generation_config.json", "chat_template.jinja")


def _config_for(layers: Any, dtype: torch.dtype) -> Any:
    from .hf import copy_config

    config = copy_config(layers.config)
    config.use_cache = True
    config.architectures = [type(layers.skeleton).__name__]
    name = str(dtype).removeprefix("torch.")
    config.dtype = name
    return config


def _finish(layers: Any, out: Path, weight_map: Mapping[str, str], total: int,
            dtype: torch.dtype) -> None:
    _config_for(layers, dtype).save_pretrained(str(out))
    write_index(out, weight_map, total)
    if layers.directory is not None:
        for name in _SIDE_FILES:
            src = layers.directory / name
            if src.is_file():
                shutil.copyfile(src, out / name)


def _skipped(layers: Any) -> set[str]:
    """Names not written: the head's weight of a tied model."""
    return {layers.tie_names()[1]} if layers.tied else set()


def save_from_trainer(trainer: Any, out: Path) -> Path:
    """See :func:`chameleon_elastic.models.hf.save_pretrained`."""
    import torch.distributed as dist

    from chameleon_elastic.runtime.errors import PeerLost

    from .hf import layers_of

    layers = layers_of(trainer.model)
    out.mkdir(parents=True, exist_ok=True)
    holders = trainer.holders
    writers = sorted({devs[0] for devs in holders.values()})
    skip = _skipped(layers)
    state = trainer.state()   # whole tensors (a collective over the unit under tp)
    mine = {name: value for layer, tensors in state.items()
            if holders[layer][0] == trainer.device for name, value in tensors.items()
            if name not in skip}
    if mine and trainer.tp_rank == 0:
        write_shard(out / shard_name(writers.index(trainer.device), len(writers)), mine)
    if dist.get_rank() == 0:
        weight_map, total = {}, 0
        itemsize = torch.empty((), dtype=layers.dtype).element_size()
        for layer, devs in holders.items():
            for name in layers.names(layer):
                if name not in skip:
                    weight_map[name] = shard_name(writers.index(devs[0]), len(writers))
        total = sum(layers.numel(i) for i in holders) * itemsize
        _finish(layers, out, weight_map, total, layers.dtype)
    try:
        dist.barrier()
    except RuntimeError as exc:
        raise PeerLost(f"device {trainer.device} lost a peer while saving {out}: {exc}") from exc
    return out


def convert(checkpoint: Path, source: Any, out: Path, step: int | None = None) -> Path:
    """See :func:`chameleon_elastic.models.hf.convert_checkpoint`."""
    from chameleon_elastic.runtime.errors import PipelineRuntimeError
    from chameleon_elastic.runtime.state.checkpoint import latest_step, load_layers, saved_layers

    from .hf import HFModelError, causal_lm, layers_of

    if step is None:
        step = latest_step(checkpoint)
        if step is None:
            raise HFModelError(f"{checkpoint} holds no committed checkpoint (no 'latest' "
                               "file); pass the --checkpoint-dir a training run wrote.")
    model = causal_lm(source)
    layers = layers_of(model)
    n = model.num_layers
    try:
        found = saved_layers(checkpoint, step)
    except PipelineRuntimeError as exc:
        raise HFModelError(str(exc)) from None
    if found != list(range(n)):
        raise HFModelError(f"{checkpoint / f'step-{step}'} holds layers {found[:6]}... but the "
                           f"model has {n}; pass the model the checkpoint was trained from.")
    out.mkdir(parents=True, exist_ok=True)
    skip = _skipped(layers)
    weight_map: dict[str, str] = {}
    total = 0
    dtype = torch.float32
    for layer in range(n):   # one layer in memory at a time
        state = load_layers(checkpoint, step, [layer])[layer]
        params = {k: v for k, v in state.params.items() if k not in skip}
        name = shard_name(layer, n)
        write_shard(out / name, params)
        weight_map.update({k: name for k in params})
        total += sum(v.numel() * v.element_size() for v in params.values())
        dtype = next((v.dtype for v in params.values() if v.is_floating_point()), dtype)
    _finish(layers, out, weight_map, total, dtype)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from chameleon_elastic.console import CliParser

    from .hf import HFModelError

    ap = CliParser(
        prog="python -m chameleon_elastic.models.hf",
        description="Convert a runtime checkpoint (step-N/, torch.distributed.checkpoint, "
                    "written by trainer.run(..., checkpoint_every=K)) of a model made by "
                    "causal_lm into "
                    "a directory transformers' AutoModelForCausalLM.from_pretrained loads.",
        epilog="example: python -m chameleon_elastic.models.hf convert ckpt --model tiny "
               "-o exported")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="runtime checkpoint -> transformers directory")
    c.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    c.add_argument("--model", required=True, metavar="DIR",
                   help="the save_pretrained directory the run started from (its config.json "
                        "and tokenizer files are copied)")
    c.add_argument("-o", "--out", required=True, metavar="OUT")
    c.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: the latest)")
    args = ap.parse_args(argv)
    try:
        out = convert(Path(args.checkpoint), args.model, Path(args.out), args.step)
    except HFModelError as exc:
        ap.error(str(exc))
    print(f"wrote {out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
    return 0
