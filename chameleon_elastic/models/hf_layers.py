"""A Hugging Face causal LM as a list of pipeline layers, built one layer at a time.

Layer 0 is the embedding plus what the model computes once before its blocks (positions,
rotary tables, a sliding-window mask); layers 1..n are the decoder layers; layer n + 1 is the
final norm and the LM head. What flows between layers is a dict of tensors (``hidden_states``,
and ``cos`` / ``sin`` / ``sliding_mask`` where the family has them), which the runtime sends
leaf by leaf; only ``hidden_states`` carries a gradient back.

How a family splits comes from its config's ``base_model_pp_plan`` where it has one (the
token embedding, the decoder-layer list and the final norm, named as the model names them), so
a family with such a plan needs one line in :data:`SUPPORTED`; GPT-2 has none and is described
by hand (:data:`GPT2`).

No layer is ever built from the whole model. The model is built once per process on the meta
device (no memory), as a *skeleton* that gives each layer's submodules, their names and
shapes; layer ``i`` then copies its submodules out of the skeleton with fresh, empty tensors
(:func:`materialize`) and fills them from the safetensors files or with transformers' own
initialisation. Each layer module keeps its submodules under the model's own dotted names
(``model.layers.3.self_attn.q_proj``), so a layer's ``state_dict`` keys are the checkpoint's
keys: loading, saving and the tensor-parallel plan all use them as they are.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["GPT2", "SUPPORTED", "Family", "Layout", "Stage", "layout_of", "materialize"]


@dataclass(frozen=True)
class Family:
    """Where a family keeps the parts of its base model (paths relative to it).

    ``tokens``: the token embedding; ``positions``: a learned position embedding (GPT-2), or
    None; ``rotary``: the rotary-embedding module whose ``(cos, sin)`` every layer takes, or
    None; ``dropout``: the dropout after the embedding, or None; ``blocks``: the decoder-layer
    list; ``norm``: the final norm."""

    tokens: str
    blocks: str
    norm: str
    positions: str | None = None
    rotary: str | None = None
    dropout: str | None = None


#: GPT-2's base model has no ``base_model_pp_plan``: its parts, named as GPT2Model names them.
GPT2 = Family(tokens="wte", positions="wpe", dropout="drop", blocks="h", norm="ln_f")

#: model_type -> None (the config's ``base_model_pp_plan`` says how it splits) or a Family.
SUPPORTED: dict[str, Family | None] = {
    "llama": None, "mistral": None, "qwen2": None, "qwen3": None, "gpt2": GPT2,
}


def family_from_pp_plan(plan: dict[str, Any], base: nn.Module) -> Family:
    """The Family a ``base_model_pp_plan`` describes: its first entry takes ``input_ids``
    (the token embedding), the entry that takes ``attention_mask`` is the decoder-layer list,
    the last one the final norm; a ``rotary_emb`` beside them is computed once, in layer 0."""
    names = list(plan)
    blocks = next(n for n in names if "attention_mask" in plan[n][0])
    return Family(tokens=names[0], blocks=blocks, norm=names[-1],
                  rotary="rotary_emb" if hasattr(base, "rotary_emb") else None)


def copy_config(config: Any) -> Any:
    """A transformers config that can be changed without changing ``config``."""
    return config.__class__.from_dict(config.to_dict())


def materialize(module: nn.Module, device: torch.device | str,
                dtype: torch.dtype) -> nn.Module:
    """A copy of a meta-device ``module`` with empty (uninitialised) tensors on ``device``;
    floating parameters take ``dtype``. The tensors are made first and handed to ``deepcopy``
    as already copied, so no meta tensor is ever copied: this works under torch's
    FakeTensorMode too (where ``to_empty`` cannot swap parameters), which the runtime uses to
    size stage boundaries."""
    memo: dict[int, Any] = {}

    def empty(t: torch.Tensor, floating: bool) -> torch.Tensor:
        kind = dtype if floating and t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                memo[id(p)] = nn.Parameter(empty(p, True), requires_grad=p.requires_grad)
        for b in m._buffers.values():
            if b is not None:
                memo[id(b)] = empty(b, False)
        for t in vars(m).values():   # tensors kept as plain attributes (rotary tables)
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = empty(t, False)
    return copy.deepcopy(module, memo)


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``path`` under ``root``, making plain containers on the way,
    so that its parameters are named as in the whole model."""
    *parents, last = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(last, module)


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


@dataclass(frozen=True)
class Layout:
    """One model's split: its family, the base model's name in the whole model
    (``base_model_prefix``), the LM head's name, the decoder count and, per decoder, whether
    it attends through a sliding window (and how wide)."""

    family: Family
    prefix: str
    head: str
    blocks: int
    windows: tuple[int | None, ...]

    @property
    def num_layers(self) -> int:
        return self.blocks + 2

    def path(self, part: str) -> str:
        return f"{self.prefix}.{part}" if self.prefix else part

    def parts(self, layer: int) -> tuple[str, ...]:
        """Dotted names (in the whole model) of the submodules layer ``layer`` holds."""
        f = self.family
        if layer == 0:
            return tuple(self.path(p) for p in (f.tokens, f.positions, f.rotary, f.dropout)
                         if p is not None)
        if layer <= self.blocks:
            return (self.path(f"{f.blocks}.{layer - 1}"),)
        return (self.path(f.norm), self.head)


def layout_of(skeleton: nn.Module, family: Family | None) -> Layout:
    """The :class:`Layout` of a whole (meta) ``*ForCausalLM`` model."""
    config = skeleton.config
    prefix = skeleton.base_model_prefix
    base = getattr(skeleton, prefix)
    if family is None:
        family = family_from_pp_plan(dict(config.base_model_pp_plan), base)
    head_module = skeleton.get_output_embeddings()
    head = next(n for n, m in skeleton.named_modules() if m is head_module)
    blocks = len(base.get_submodule(family.blocks))
    window = getattr(config, "sliding_window", None)
    # layer_types where the config has them (Qwen2, Qwen3); Mistral has none and slides in
    # every layer when it has a window
    kinds = getattr(config, "layer_types", None) or (
        ["sliding_attention" if window else "full_attention"] * blocks)
    windows = tuple(window if kind == "sliding_attention" and window else None
                    for kind in kinds[:blocks])
    return Layout(family, prefix, head, blocks, windows)


def sliding_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Which keys each query sees through a window of ``window`` positions, causally (True:
    attend): transformers' rule, ``q - window < k <= q``, as a boolean (1, 1, T, T) mask."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


class Stage(nn.Module):
    """One pipeline layer of a causal LM: its submodules under their names in the whole model,
    and the forward of its part (embedding, decoder ``index`` or head)."""

    def __init__(self, layout: Layout, layer: int, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for path, module in parts.items():
            _place(self, path, module)
        self._layout = layout
        self._layer = layer

    def forward(self, x: Any) -> Any:
        layout, layer = self._layout, self._layer
        if layer == 0:
            return self._embed(x)
        if layer <= layout.blocks:
            return self._block(x)
        f = layout.family
        hidden = _get(self, layout.path(f.norm))(x["hidden_states"])
        return _get(self, layout.head)(hidden)

    def _embed(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        layout, f = self._layout, self._layout.family
        hidden = _get(self, layout.path(f.tokens))(input_ids)
        length = input_ids.shape[-1]
        positions = torch.arange(length, device=input_ids.device)[None]
        if f.positions is not None:
            hidden = hidden + _get(self, layout.path(f.positions))(positions)
        if f.dropout is not None:
            hidden = _get(self, layout.path(f.dropout))(hidden)
        out = {"hidden_states": hidden}
        if f.rotary is not None:
            cos, sin = _get(self, layout.path(f.rotary))(hidden, position_ids=positions)
            out["cos"], out["sin"] = cos, sin
        windows = {w for w in layout.windows if w is not None and w < length}
        if len(windows) > 1:
            raise ValueError("internal: one sliding window per model is supported")
        if windows:
            out["sliding_mask"] = sliding_mask(length, windows.pop(), input_ids.device)
        return out

    def _block(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layout, f, index = self._layout, self._layout.family, self._layer - 1
        block = _get(self, layout.path(f"{f.blocks}.{index}"))
        kwargs: dict[str, Any] = {}
        if "cos" in x:
            kwargs["position_embeddings"] = (x["cos"], x["sin"])
        if layout.windows[index] is not None and "sliding_mask" in x:
            kwargs["attention_mask"] = x["sliding_mask"]
        hidden = block(x["hidden_states"], **kwargs)
        if isinstance(hidden, tuple):   # older transformers return (hidden, ...)
            hidden = hidden[0]
        return {**x, "hidden_states": hidden}


def init_modules(skeleton: nn.Module, modules: Iterable[nn.Module]) -> None:
    """transformers' own initialisation of ``modules`` (the model's ``_init_weights``: normal
    weights at ``initializer_range``, GPT-2's scaled residual projections, ones for norms,
    rotary tables computed), drawing from torch's generator, which the runtime seeds per
    layer. Children before parents, as transformers applies it: a parent's rule (GPT-2's
    scaled ``c_proj``) must come after its children's generic one."""
    with torch.no_grad():
        for m in modules:
            m.apply(skeleton._init_weights)
