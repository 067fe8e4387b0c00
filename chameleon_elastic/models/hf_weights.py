"""Reading and writing a ``save_pretrained`` directory's safetensors files, tensor by tensor.

A stage reads only its own layers' tensors: :class:`WeightFiles` maps each tensor name to its
file (``model.safetensors.index.json`` for a sharded checkpoint, the file's own header
otherwise) and opens files with safetensors' ``safe_open``, which maps the file and copies out
only the tensors asked for. Nothing is unpickled: a directory that holds only
``pytorch_model.bin`` is refused. Every name read is recorded (:func:`tensors_read`), so a test
can check that a device read its layers and nothing else.

Writing is the mirror: :func:`write_shard` saves a dict of tensors as one safetensors file, and
:func:`write_index` the index transformers' ``from_pretrained`` follows to the shards.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

__all__ = ["WeightFiles", "clear_reads", "has_weights", "shard_name", "tensors_read",
           "write_index", "write_shard"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_READS: list[str] = []


def tensors_read() -> tuple[str, ...]:
    """Names of every tensor this process read from safetensors files, in order."""
    return tuple(_READS)


def clear_reads() -> None:
    _READS.clear()


class WeightFiles:
    """The tensors of one ``save_pretrained`` directory, by name, read on demand."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        index = directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        else:
            self.files = {}
            for path in sorted(directory.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self.files.update({name: path for name in f.keys()})  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (each file opened once), recorded in :func:`tensors_read`."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.files[name]].append(name)
        out = {}
        for path, wanted in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name)
                    _READS.append(name)
        return out


def has_weights(directory: Path) -> bool:
    return (directory / INDEX).is_file() or any(directory.glob("*.safetensors"))


def shard_name(k: int, n: int) -> str:
    """transformers' name for shard ``k`` (0-based) of ``n``; one file is model.safetensors."""
    return SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Save ``tensors`` (whole, contiguous copies) as one safetensors file, atomically."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    tmp.replace(path)


def write_index(directory: Path, weight_map: Mapping[str, str], total_bytes: int) -> None:
    """The shard index (only when there is more than one file)."""
    if len(set(weight_map.values())) <= 1:
        return
    text = json.dumps({"metadata": {"total_size": total_bytes},
                       "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    (directory / INDEX).write_text(text + "\n")
