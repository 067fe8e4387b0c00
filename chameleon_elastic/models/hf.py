"""Hugging Face causal LMs on the runtime: ``causal_lm(source) -> PipelineModel``, and back.

    from chameleon_elastic.models import hf
    model = hf.causal_lm("path/to/saved", sample=my_sample)      # or a PretrainedConfig
    trainer = PipelineTrainer.from_env(model, ...)
    trainer.run(steps, report)
    hf.save_pretrained(trainer, "out")                            # every process calls it

``source`` is a directory written by transformers' ``save_pretrained`` (``config.json`` plus
safetensors, sharded or not; a directory with only ``config.json`` starts from random weights)
or a ``transformers.PretrainedConfig`` (random initialisation, transformers' own, drawn under
the runtime's per-layer seed). The model becomes ``n + 2`` layers (:mod:`.hf_layers`): the
embedding with what is computed once, each decoder layer, the final norm with the head. Tied
embeddings become a :class:`~chameleon_elastic.runtime.Tie`. A sample is ``(input_ids,
labels)`` and the loss is transformers' causal-LM loss (labels shifted inside, ``-100``
ignored), the mean over one micro-batch's counted tokens.

Pretrained weights are read per layer: a device builds only its own layers and reads only
their tensors (:mod:`.hf_weights`); a layer that moves at a re-plan comes from peers, as
always. While the runtime sizes stage boundaries on fake tensors, layers are built empty.

Under ``training.tp > 1`` the config's ``base_model_tp_plan`` shards each decoder layer
(``colwise`` / ``rowwise`` as torch's ``ColwiseParallel`` / ``RowwiseParallel``, and
``replicated_with_grad_allreduce``, Qwen3's per-head q/k norms, as :class:`.hf_tp.SumGradients`);
the embedding and the head stay whole on every card.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chameleon_elastic.runtime.model import PipelineModel, Tie, sizing_boundaries

from .hf_export import convert, save_from_trainer
from .hf_layers import SUPPORTED, Layout, Stage, copy_config, init_modules, layout_of, materialize
from .hf_weights import has_weights

__all__ = ["TINY", "CausalLMLayers", "HFModelError", "TokenWindows", "adamw", "causal_lm",
           "convert_checkpoint", "decays", "layers_of", "load_config", "parameter_count",
           "require_extra", "save_pretrained", "tiny_config", "token_windows"]

EXTRA = "pip install 'chameleon-elastic[hf]'  (transformers and safetensors)"


class HFModelError(ValueError):
    """A model that cannot be adapted; the message is one sentence naming the fix."""


def require_extra(what: str = "chameleon_elastic.models.hf") -> None:
    """transformers and safetensors, or one sentence saying how to get them."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise HFModelError(f"{what} needs transformers and safetensors, which are not "
                           f"installed ({exc.name} is missing): {EXTRA}.") from None


def load_config(source: Any) -> tuple[Any, Path | None]:
    """The config, and the directory it came from (None for a config object)."""
    require_extra()
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return copy_config(source), None
    directory = Path(source)
    if not directory.is_dir():
        where = "is a file, not a directory" if directory.exists() else "does not exist"
        raise HFModelError(
            f"the model directory {str(directory)!r} {where}; pass the directory that "
            "transformers' save_pretrained wrote (config.json plus model*.safetensors), or a "
            "PretrainedConfig.")
    if not (directory / "config.json").is_file():
        raise HFModelError(
            f"{str(directory)!r} has no config.json; pass a directory written by "
            "transformers' save_pretrained (config.json plus model*.safetensors) or a "
            "PretrainedConfig.")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFModelError(f"cannot read {directory / 'config.json'}: {first}") from None
    return config, directory


def _check_supported(config: Any) -> None:
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        arch = ", ".join(getattr(config, "architectures", None) or []) or kind
        raise HFModelError(
            f"architecture {arch} (model_type {kind!r}) is not supported; supported causal "
            f"LMs: {', '.join(sorted(SUPPORTED))}.")
    if SUPPORTED[kind] is None and not getattr(config, "base_model_pp_plan", None):
        raise HFModelError(f"model_type {kind!r} has no base_model_pp_plan in this version of "
                           "transformers; install transformers >= 4.52.")


_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop", "dropout")

_PRIVATE = ("_skeleton", "_files")


class CausalLMLayers:
    """``build_layer`` of a causal LM: layer ``i`` built alone, from the safetensors files of
    ``directory`` when it has them, else with transformers' initialisation. Holds the meta
    skeleton (built on first use, not pickled) that gives each layer's submodules."""

    def __init__(self, config: Any, directory: Path | None, dtype: torch.dtype) -> None:
        self.config = config
        self.directory = directory
        self.dtype = dtype
        self.pretrained = directory is not None and has_weights(directory)
        self._skeleton: nn.Module | None = None
        self._files = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: (None if k in _PRIVATE else v) for k, v in self.__dict__.items()}

    @property
    def skeleton(self) -> nn.Module:
        if self._skeleton is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(
                    self.config, attn_implementation="sdpa")
        return self._skeleton

    @functools.cached_property
    def layout(self) -> Layout:
        return layout_of(self.skeleton, SUPPORTED[self.config.model_type])

    @property
    def tied(self) -> bool:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else None
        return bool(getattr(text or self.config, "tie_word_embeddings", False))

    def tie_names(self) -> tuple[str, str]:
        """(token embedding weight, head weight), as the checkpoint names them."""
        layout = self.layout
        return f"{layout.path(layout.family.tokens)}.weight", f"{layout.head}.weight"

    def names(self, layer: int) -> tuple[str, ...]:
        """The ``state_dict`` keys of layer ``layer`` (the checkpoint's names)."""
        skeleton = self.skeleton
        out = []
        for path in self.layout.parts(layer):
            module = skeleton.get_submodule(path)
            out.extend(f"{path}.{k}" for k in module.state_dict())
        return tuple(out)

    def numel(self, layer: int) -> int:
        skeleton = self.skeleton
        return sum(p.numel() for path in self.layout.parts(layer)
                   for p in skeleton.get_submodule(path).parameters())

    def __call__(self, layer: int) -> nn.Module:
        skeleton, layout = self.skeleton, self.layout
        parts = {path: materialize(skeleton.get_submodule(path), "cpu", self.dtype)
                 for path in layout.parts(layer)}
        stage = Stage(layout, layer, parts)
        if sizing_boundaries():   # fake tensors: shapes only, nothing to read or draw
            return stage
        if self.pretrained:
            self._load(stage, layer)
        else:
            init_modules(skeleton, parts.values())
        return stage

    def _load(self, stage: Stage, layer: int) -> None:
        """This layer's tensors from the files (the head of a tied model reads the embedding,
        which save_pretrained stores once); tables that are not saved (rotary frequencies) are
        computed."""
        from .hf_weights import WeightFiles

        if self._files is None:
            self._files = WeightFiles(self.directory)
        files = self._files
        base = f"{self.layout.prefix}."
        where = {}
        for name in stage.state_dict():
            for candidate in (name, name.removeprefix(base), *self._tied_source(name)):
                if candidate in files:
                    where[name] = candidate
                    break
            else:
                raise HFModelError(
                    f"{self.directory} has no tensor {name!r} for layer {layer}; the "
                    "checkpoint does not match its config.json: save it again with "
                    "save_pretrained.")
        tensors = files.read(sorted(set(where.values())))
        with torch.no_grad():
            for name, target in stage.state_dict(keep_vars=True).items():
                value = tensors[where[name]]
                if value.shape != target.shape:
                    raise HFModelError(
                        f"tensor {where[name]!r} in {self.directory} has shape "
                        f"{tuple(value.shape)} but the config makes {tuple(target.shape)}; "
                        "the checkpoint does not match its config.json.")
                target.copy_(value)
        unsaved = [m for m in stage.modules()
                   if not any(True for _ in m.parameters())
                   and (m._non_persistent_buffers_set
                        or any(isinstance(v, torch.Tensor) for v in vars(m).values()))]
        for m in unsaved:
            with torch.no_grad():
                self.skeleton._init_weights(m)

    def _tied_source(self, name: str) -> tuple[str, ...]:
        tokens, head = self.tie_names()
        if self.tied and name == head:
            return (tokens, tokens.removeprefix(f"{self.layout.prefix}."))
        return ()

    def tp_plan(self, layer: int) -> dict[str, Any] | None:
        """Layer ``layer``'s tensor-parallel plan from the config's ``base_model_tp_plan``
        (decoder layers only; the embedding and the head stay whole on every card)."""
        if not 1 <= layer <= self.layout.blocks:
            return None
        plan = getattr(self.config, "base_model_tp_plan", None)
        if not plan:
            return None
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from .hf_tp import SumGradients

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                  "replicated_with_grad_allreduce": SumGradients}
        blocks = self.layout.family.blocks
        out: dict[str, Any] = {}
        for pattern, style in plan.items():
            head, _, rest = pattern.partition(".*.")
            if head != blocks or not rest:
                continue
            if style not in styles:
                raise HFModelError(
                    f"{self.config.model_type}'s tensor-parallel plan shards {rest} as "
                    f"{style!r}, which the runtime does not support (only colwise, rowwise "
                    "and replicated_with_grad_allreduce); train it with training.tp = 1.")
            out[self.layout.path(f"{blocks}.{layer - 1}.{rest}")] = styles[style]()
        return out or None


def _causal_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size)


class TokenWindows(torch.utils.data.Dataset):
    """A token stream cut into windows of ``context`` tokens, a map-style dataset: item ``i``
    is ``(input_ids, labels)`` of window ``i`` (the same tokens: the loss shifts)."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        if tokens.numel() < context:
            raise HFModelError(f"the data holds {tokens.numel()} tokens, fewer than one "
                               f"context of {context}; give more text or a shorter context.")
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return self.tokens.numel() // self.context

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        window = self.tokens[index * self.context:(index + 1) * self.context]
        return window, window.clone()


def token_windows(tokens: torch.Tensor, context: int, index: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` of a token stream: a window of ``context`` tokens at a fixed
    pseudo-random offset, as ``(input_ids, labels)`` (the same tokens: the loss shifts)."""
    span = tokens.numel() - context
    if span < 1:
        raise HFModelError(f"the data holds {tokens.numel()} tokens, fewer than one context of "
                           f"{context} + 1; give more text or a shorter context.")
    start = (index * 1_000_003) % span
    window = tokens[start:start + context]
    return window, window.clone()


def _random_tokens(vocab: int, context: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, vocab, (context,), generator=g)
    return ids, ids.clone()


def decays(name: str) -> bool:
    """Whether AdamW decays parameter ``name`` (transformers' name): not a bias, not a norm's
    weight (``*norm*``, as Llama, Mistral and Qwen name theirs, or GPT-2's ``ln_*``)."""
    parts = name.split(".")
    return parts[-1] != "bias" and not any("norm" in p or p.startswith("ln_") for p in parts)


def adamw(named: Iterable[tuple[str, nn.Parameter]], lr: float = 3e-4,
          weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)
          ) -> torch.optim.Optimizer:
    """AdamW over ``(name, parameter)`` pairs with weight decay on everything but norms and
    biases (:func:`decays`), as LLMs are trained. Groups are chosen by transformers' names, so
    the split is the same whatever layers a device holds."""
    named = list(named)
    groups = [{"params": [(n, p) for n, p in named if decays(n) == decay],
               "weight_decay": weight_decay if decay else 0.0} for decay in (True, False)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


def _own_name(layer: int, name: str) -> str:
    """A stage's names are transformers' already (``model.layers.3.mlp.up_proj.weight``)."""
    return name


def causal_lm(source: Any, *, sample: Callable[[int], tuple[Any, Any]] | None = None,
              dataset: Any = None,
              make_optimizer: Callable[[Iterable[tuple[str, nn.Parameter]]],
                                       torch.optim.Optimizer]
              | None = None, make_scheduler: Callable[[torch.optim.Optimizer], Any]
              | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
              dropout: float | None = None, context: int = 128) -> PipelineModel:
    """The runtime's model of a Hugging Face causal LM (see the module's docstring).

    ``sample(index) -> (input_ids, labels)``: one global sample (default: random tokens of
    ``context`` length, for profiling and tests); or ``dataset``: a map-style dataset of such
    pairs (e.g. :class:`TokenWindows`), read in seeded epochs. ``make_optimizer``: gets ``(name,
    parameter)`` pairs under transformers' names (torch's optimizers take them as they are);
    default :func:`adamw`.
    ``dtype``: the master weights' type (float32; float64 for exact comparisons).
    ``dropout``: replaces every dropout probability of the config (None: the config's); its
    masks depend only on (seed, step, micro-batch, layer), so every plan trains alike
    (docs/runtime.md, reproducible dropout).
    """
    config, directory = load_config(source)
    _check_supported(config)
    config.use_cache = False
    if dropout is not None:
        for key in _DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, dropout)
    if directory is not None and not has_weights(directory) and any(
            directory.glob("pytorch_model*.bin")):
        raise HFModelError(
            f"{directory} holds its weights only as pytorch_model*.bin, which is never "
            "unpickled here; save it again with save_pretrained(..., safe_serialization=True).")
    layers = CausalLMLayers(config, directory, dtype)
    vocab = int(config.get_text_config().vocab_size)
    n = layers.layout.num_layers
    tied = (Tie(((0, layers.tie_names()[0]), (n - 1, layers.tie_names()[1]))),) \
        if layers.tied else ()
    return PipelineModel(
        num_layers=n,
        build_layer=layers,
        loss=functools.partial(_causal_loss, vocab_size=vocab),
        make_optimizer=make_optimizer or adamw,
        sample=None if dataset is not None else (
            sample or functools.partial(_random_tokens, vocab, context)),
        dataset=dataset,
        seed=seed,
        make_scheduler=make_scheduler,
        tied=tied,
        tp_plan=layers.tp_plan,
        parameter_name=_own_name,
        named_parameters=True,
    )


def layers_of(model: PipelineModel) -> CausalLMLayers:
    """The adapter behind a model made by :func:`causal_lm`, or one sentence."""
    if not isinstance(model.build_layer, CausalLMLayers):
        raise HFModelError("this trainer's model was not made by "
                           "chameleon_elastic.models.hf.causal_lm; only such models can be "
                           "saved in transformers' format.")
    return model.build_layer


def save_pretrained(trainer: Any, out_dir: str | Path) -> Path:
    """Write the trained model as a directory ``AutoModelForCausalLM.from_pretrained`` loads.
    Collective: every process of the job calls it (see :mod:`.hf_export`)."""
    return save_from_trainer(trainer, layers_of(trainer.model), Path(out_dir))


def convert_checkpoint(checkpoint_dir: str | Path, source: Any, out_dir: str | Path,
                       step: int | None = None) -> Path:
    """A runtime checkpoint (``step-N/``, DCP) as a transformers directory, offline;
    ``source``: the model's directory or config (for config.json)."""
    from chameleon_elastic.runtime.errors import PipelineRuntimeError
    from chameleon_elastic.runtime.state.checkpoint import latest_step, saved_layers

    checkpoint = Path(checkpoint_dir)
    if step is None:
        step = latest_step(checkpoint)
        if step is None:
            raise HFModelError(f"{checkpoint} holds no committed checkpoint (no 'latest' "
                               "file); pass the --checkpoint-dir a training run wrote.")
    model = causal_lm(source)
    n = model.num_layers
    try:
        found = saved_layers(checkpoint, step)
    except PipelineRuntimeError as exc:
        raise HFModelError(str(exc)) from None
    if found != list(range(n)):
        raise HFModelError(f"{checkpoint / f'step-{step}'} holds layers {found[:6]}... but the "
                           f"model has {n}; pass the model the checkpoint was trained from.")
    return convert(checkpoint, step, layers_of(model), Path(out_dir))


def parameter_count(model: PipelineModel) -> Sequence[int]:
    """Parameters per layer, from the meta skeleton (nothing is built)."""
    layers = layers_of(model)
    return [layers.numel(i) for i in range(model.num_layers)]


#: Tiny random configs for examples and tests: hidden 32, vocabulary 288 (room for the 256
#: byte values), 4 heads; name -> (config class, its arguments).
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2-tiny": ("Qwen2Config", {"tie_word_embeddings": False}),
    "mistral-tiny": ("MistralConfig", {"sliding_window": 32}),
    "qwen3-tiny": ("Qwen3Config", {"head_dim": 8}),
    "gpt2-tiny": ("GPT2Config", {}),
}


def tiny_config(name: str, layers: int = 2) -> Any:
    """A tiny random config of a supported family (:data:`TINY`), with ``layers`` decoder
    layers and no dropout."""
    require_extra()
    import transformers

    if name not in TINY:
        raise HFModelError(f"unknown tiny config {name!r}; choose one of: "
                           f"{', '.join(TINY)}.")
    cls, extra = TINY[name]
    if cls == "GPT2Config":
        common = {"n_embd": 32, "n_layer": layers, "n_head": 4, "n_positions": 512,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                  "bos_token_id": 0, "eos_token_id": 0}
    else:
        common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
                  "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 0}
    return getattr(transformers, cls)(vocab_size=288, **common, **extra)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m chameleon_elastic.models.hf convert``: :func:`convert_checkpoint`."""
    from chameleon_elastic.console import CliParser

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
        out = convert_checkpoint(args.checkpoint, args.model, args.out, args.step)
    except HFModelError as exc:
        ap.error(str(exc))
    print(f"wrote {out}: loads with transformers.AutoModelForCausalLM.from_pretrained")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
