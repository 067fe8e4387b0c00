"""Runtime-side layer profiler: a job spec's ``[model]`` figures measured on the very layers a
script trains, as a :class:`chameleon_elastic.profile.MeasuredProfile` (``how = "layers"``).

Each layer is built alone (as a stage would build it, same seed) and fed the previous layer's
real output for one micro-batch. Per layer:

- ``forward_s`` / ``backward_s``: forward with the input requiring gradients, then backward from
  a gradient of ones, ``repeats`` times after ``warmup`` untimed runs, the device synchronised
  around each clock reading; the median is kept, which shrugs off the odd descheduling on a
  shared machine. With ``precision`` bf16 or fp16 the forward runs under ``torch.autocast`` on
  the device's type, as mixed-precision training runs it.
- ``activation_bytes``: the bytes autograd saves for backward during the forward (every tensor
  passed to ``saved_tensors_hooks``' pack hook, each distinct storage counted once, the
  parameters' own storages excluded): what a stage keeps per micro-batch in flight. Under
  autocast this includes the low-precision copies of the weights, which are made per forward.
  Tensors a custom ``autograd.Function`` keeps as plain ``ctx`` attributes are invisible to it.
- ``boundary_bytes``: the bytes of the layer's output, what one micro-batch sends to the next
  stage when a pipeline is cut after this layer.
- ``param_bytes`` / ``optimizer_bytes``: the parameters, and the optimizer's state after one real
  ``step()`` (state is created lazily).

The launcher measures whole scripts instead (``chameleon-run --profile-out``) and writes the same
format; either file feeds ``chameleon-run --profile``. From the command line::

    python -m chameleon_elastic.runtime.profiler MODULE:FACTORY --out profile.json \\
        [--micro-batch-size N] [--precision fp32|bf16|fp16] [--device cpu|cuda:0] ...

where ``FACTORY`` (a module path or a ``file.py``) is called without arguments and returns the
``PipelineModel``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from chameleon_elastic.profile import MeasuredProfile, ModelFigures
from chameleon_elastic.spec import PRECISIONS

from .errors import PipelineRuntimeError
from .model import PipelineModel, build_layers, collate, make_optimizer
from .precision import Precision, autocast, check_precision
from .tensors import flatten, leaf_map

__all__ = ["main", "profile_layers"]


def _storage_key(t: torch.Tensor) -> tuple[str, int, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (some subclasses)
        return None
    return (str(t.device), storage.data_ptr(), storage.nbytes())


def _distinct_bytes(tensors: Iterable[torch.Tensor],
                    exclude: Collection[tuple[str, int, int]] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``: a view or a tensor saved twice is
    memory held once."""
    seen: set[tuple[str, int, int]] = set()
    for t in tensors:
        key = _storage_key(t)
        if key is not None and key not in exclude:
            seen.add(key)
    return sum(key[2] for key in seen)


def _nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for queued work on ``device`` (the device plugin's ``synchronize``; nothing on
    CPU) so that a clock reading covers the kernels, not only their launch."""
    from chameleon_elastic.plugins import PluginError, get_backend

    try:
        backend = get_backend(device.type)
    except PluginError:
        return lambda: None
    return lambda: backend.synchronize(device.index or 0)


def _leaves(tree: Any) -> list[torch.Tensor]:
    return flatten(tree, "a layer's output")[0]


def _fresh_input(tree: Any) -> Any:
    """The input tree detached from the previous layer, floating leaves requiring gradients
    (as a stage's received input does), so the layer's backward is timed whole."""
    return leaf_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), tree)


def _forward_saving(layer: torch.nn.Module, inp: Any, precision: Precision,
                    device: torch.device) -> tuple[Any, int]:
    """One forward with autograd's saved tensors counted: (output, activation bytes)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(precision, device):
        out = layer(inp)
    params = {k for k in (_storage_key(p) for p in layer.parameters()) if k is not None}
    return out, _distinct_bytes(saved, exclude=params)


def _backward(out: Any) -> None:
    outs = [t for t in _leaves(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def profile_layers(model: PipelineModel, micro_batch_size: int = 1, repeats: int = 5,
                   warmup: int = 1, device: torch.device | str | None = None,
                   precision: str = "fp32",
                   progress: Callable[[int], None] | None = None) -> MeasuredProfile:
    """Measure every layer of ``model`` on one micro-batch of ``micro_batch_size`` samples.

    The result's ``apply(spec)`` puts the figures into a job spec; ``write(path)`` makes the
    file ``chameleon-run --profile`` takes. Needs one layer's parameters, optimizer state and
    activations in memory at a time, never the whole model's. ``progress(i)`` is called after
    layer ``i`` is measured (a large model takes a while).
    """
    mode = check_precision(precision)
    if micro_batch_size < 1 or repeats < 1 or warmup < 0:
        raise PipelineRuntimeError(
            f"profile_layers needs micro_batch_size >= 1, repeats >= 1 and warmup >= 0 (got "
            f"{micro_batch_size}, {repeats}, {warmup}); pass such values."
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    sync = _synchronizer(device)
    x, _ = collate(model, range(micro_batch_size))
    x = leaf_map(lambda t: t.to(device), x)
    fwd, bwd, params, optim, acts, bounds = [], [], [], [], [], []
    for i in range(model.num_layers):
        layer = build_layers(model, i, i + 1)[0].to(device)
        out, saved_bytes = _forward_saving(layer, _fresh_input(x), mode, device)
        _backward(out)
        f_times, b_times = [], []
        for rep in range(warmup + repeats):
            inp = _fresh_input(x)
            sync()
            t0 = time.perf_counter()
            with autocast(mode, device):
                out = layer(inp)
            sync()
            t1 = time.perf_counter()
            _backward(out)
            sync()
            t2 = time.perf_counter()
            if rep >= warmup:
                f_times.append(t1 - t0)
                b_times.append(t2 - t1)
        optimizer = make_optimizer(model, {i: layer})
        optimizer.step()
        state = [v for s in optimizer.state.values() for v in s.values()]
        fwd.append(statistics.median(f_times))
        bwd.append(statistics.median(b_times))
        params.append(float(_nbytes(layer.parameters())))
        optim.append(float(_nbytes(state)))
        acts.append(float(saved_bytes))
        bounds.append(float(_nbytes(_leaves(out))))
        x = leaf_map(torch.Tensor.detach, out)
        if progress is not None:
            progress(i)
    figures = ModelFigures(
        layers=model.num_layers, forward_s=tuple(fwd), backward_s=tuple(bwd),
        param_bytes=tuple(params), optimizer_bytes=tuple(optim),
        activation_bytes=tuple(acts), boundary_bytes=tuple(bounds),
    )
    return MeasuredProfile(how="layers", precision=mode, micro_batch_size=micro_batch_size,
                           model=figures, measured_on=_describe(device))


def _describe(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


# --------------------------------------------------------------------------- command line


def _load_factory(target: str) -> Callable[[], Any]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not MODULE:FACTORY; pass e.g. "
                         "chameleon_elastic.models.toy:mlp_model or my_model.py:build.")
    if module_name.endswith(".py"):
        path = Path(module_name)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise ValueError(f"cannot load {module_name!r}: no such Python file; pass an "
                             "existing file or an importable module.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module   # so the model's functions can be found by name
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name!r} ({exc}); pass an importable "
                             "module, or a file path ending in .py.") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TypeError(f"{module_name!r} has no callable {attr!r}; name a function that "
                         "returns the PipelineModel.")
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m chameleon_elastic.runtime.profiler",
        description="Measure every layer of a PipelineModel (seconds, parameter, optimizer, "
                    "activation and boundary bytes per micro-batch) and write a measured "
                    "profile for chameleon-run --profile.",
        epilog="example: python -m chameleon_elastic.runtime.profiler "
               "chameleon_elastic.models.toy:mlp_model --out profile.json",
    )
    ap.add_argument("factory", metavar="MODULE:FACTORY",
                    help="a function called without arguments that returns the PipelineModel; "
                         "MODULE is an importable module or a path to a .py file")
    ap.add_argument("--out", required=True, metavar="FILE", help="where to write the profile")
    ap.add_argument("--micro-batch-size", type=int, default=1,
                    help="samples per micro-batch; must equal the job's "
                         "training.micro_batch_size (default 1)")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="fp32, or bf16 / fp16 under torch.autocast (default fp32)")
    ap.add_argument("--device", default="cpu", help="torch device to measure on (default cpu)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per layer (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    args = ap.parse_args(argv)
    try:
        factory = _load_factory(args.factory)
        device = torch.device(args.device)
    except (ValueError, TypeError, RuntimeError) as exc:   # torch.device: RuntimeError
        ap.error(str(exc))
    model = factory()
    if not isinstance(model, PipelineModel):
        ap.error(f"{args.factory} returned {type(model).__name__}, not a PipelineModel; "
                 "return the model the training script trains.")
    try:
        profile = profile_layers(model, args.micro_batch_size, args.repeats, args.warmup,
                                 device, args.precision)
    except PipelineRuntimeError as exc:
        ap.error(str(exc))
    try:
        path = profile.write(args.out)
    except OSError as exc:
        ap.error(f"cannot write {args.out!r} ({exc.strerror or exc}); pass a writable path.")
    f, b = profile.model.forward_s, profile.model.backward_s
    assert isinstance(f, tuple) and isinstance(b, tuple)
    print(f"wrote {path}: {model.num_layers} layers at {args.precision} on "
          f"{profile.measured_on}, forward {sum(f) * 1e3:.3f} ms and backward "
          f"{sum(b) * 1e3:.3f} ms per micro-batch of {args.micro_batch_size}; use it with "
          "chameleon-run --profile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
