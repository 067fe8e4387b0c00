"""What crosses a stage boundary: one tensor, or a tuple, list or dict of tensors.

A transformer stage may hand the next one its hidden states *and* an attention mask, so the
executor treats a stage's input and output as a small tree whose leaves are tensors. It sends
the leaves one by one (each with its own tag) and rebuilds the tree on arrival; gradients go
back only for the leaves that carry one. Trees are tuples, lists and dicts with string keys
(in insertion order), nested to any depth; anything else is refused with one sentence, because
a value the receiver cannot size in advance cannot be received.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .errors import PipelineRuntimeError

__all__ = ["Structure", "flatten", "leaf_map", "stack", "unflatten"]

#: The shape of a tree without its tensors: ``None`` for a leaf, ``("tuple" | "list", children)``
#: or ``("dict", keys, children)``.
Structure = Any


def flatten(tree: Any, what: str = "a stage's value",
            convert: bool = False) -> tuple[list[torch.Tensor], Structure]:
    """Leaves in a fixed order, and the structure that :func:`unflatten` rebuilds.
    ``convert``: other leaves (numpy arrays, numbers) become tensors (``torch.as_tensor``), as
    samples may be; a stage's output must hold tensors already."""
    if isinstance(tree, torch.Tensor):
        return [tree], None
    if isinstance(tree, (tuple, list)):
        leaves: list[torch.Tensor] = []
        kids = []
        for item in tree:
            sub, shape = flatten(item, what, convert)
            leaves.extend(sub)
            kids.append(shape)
        return leaves, ("tuple" if isinstance(tree, tuple) else "list", tuple(kids))
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        leaves = []
        kids = []
        for key in tree:
            sub, shape = flatten(tree[key], what, convert)
            leaves.extend(sub)
            kids.append(shape)
        return leaves, ("dict", tuple(tree), tuple(kids))
    if convert:
        try:
            return [torch.as_tensor(tree)], None
        except (TypeError, ValueError, RuntimeError):
            pass
    raise PipelineRuntimeError(
        f"{what} holds a {type(tree).__name__}; stages exchange tensors, or tuples, lists and "
        "dicts (string keys) of tensors, so make the layer return only those."
    )


def unflatten(leaves: Sequence[Any], structure: Structure) -> Any:
    """The tree of ``structure`` with ``leaves`` in :func:`flatten`'s order."""
    it = iter(leaves)
    out = _build(it, structure)
    if next(it, None) is not None:
        raise PipelineRuntimeError("internal: more leaves than the structure holds")
    return out


def _build(it, structure: Structure) -> Any:
    if structure is None:
        return next(it)
    if structure[0] == "dict":
        _, keys, kids = structure
        return {k: _build(it, s) for k, s in zip(keys, kids)}
    kind, kids = structure
    items = [_build(it, s) for s in kids]
    return tuple(items) if kind == "tuple" else items


def leaf_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every leaf."""
    leaves, structure = flatten(tree)
    return unflatten([fn(x) for x in leaves], structure)


def stack(trees: Sequence[Any], what: str) -> Any:
    """Samples (trees of equal structure) stacked leaf by leaf into one micro-batch."""
    flat = [flatten(t, what, convert=True) for t in trees]
    structure = flat[0][1]
    if any(s != structure for _, s in flat):
        raise PipelineRuntimeError(
            f"{what} changes structure from one sample to the next; every sample must have "
            "the same tensors, so the stage boundaries can be sized once."
        )
    columns = zip(*(leaves for leaves, _ in flat))
    return unflatten([torch.stack(list(col)) for col in columns], structure)

