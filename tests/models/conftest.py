"""Tiny Hugging Face models written with save_pretrained, shared by the tests of this folder.

Every model is built from a config offline (nothing is downloaded), with hidden size 32 and a
vocabulary of 288, so a whole test runs in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def save_tiny(directory: Path, name: str, layers: int = 2, dtype=None,
              max_shard_size: str | None = None) -> Path:
    """A tiny random ``name`` model (see ``hf.TINY``) saved with transformers' own
    save_pretrained; seeded, so two calls write the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from chameleon_elastic.models import hf

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(hf.tiny_config(name, layers=layers))
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> directory, made once per session on first use."""
    made: dict[tuple, Path] = {}

    def get(name: str, layers: int = 2, **kwargs) -> Path:
        key = (name, layers, *sorted(kwargs.items()))
        if key not in made:
            made[key] = save_tiny(tmp_path_factory.mktemp(name), name, layers, **kwargs)
        return made[key]

    return get
