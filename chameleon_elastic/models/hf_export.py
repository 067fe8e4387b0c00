"""Saving a trained causal LM in transformers' own format, from a live job or a checkpoint.

The writers only: the adapter (:mod:`.hf`) checks what it is asked to save, hands over its
layers (``CausalLMLayers``) and says what went wrong in one sentence; nothing here imports it.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .hf_layers import copy_config
from .hf_weights import shard_name, write_index, write_shard

__all__ = ["convert", "save_from_trainer"]

#: Files of a source directory that describe the tokenizer and generation, copied as they are.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
               "generation_config.json", "chat_template.jinja")


def _config_for(layers: Any, dtype: torch.dtype) -> Any:
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


def save_from_trainer(trainer: Any, layers: Any, out: Path) -> Path:
    """See :func:`chameleon_elastic.models.hf.save_pretrained`; ``layers``: the model's
    ``CausalLMLayers``."""
    import torch.distributed as dist

    from chameleon_elastic.runtime.errors import PeerLost

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


def convert(checkpoint: Path, step: int, layers: Any, out: Path) -> Path:
    """See :func:`chameleon_elastic.models.hf.convert_checkpoint`, which checks that
    ``checkpoint``'s ``step`` holds every layer of ``layers`` (the model's ``CausalLMLayers``)."""
    from chameleon_elastic.runtime.state.checkpoint import load_layers

    n = layers.layout.num_layers
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
