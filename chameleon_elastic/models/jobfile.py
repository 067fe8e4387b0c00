"""``chameleon-job hf DIR --devices N ... -o job.toml``: the job file a model needs, from the model.

A job file's ``[model]`` figures are guesses when written by hand, and a layer count that does
not match the script's model only shows in a worker's log. Here they come from the model:

- ``layers``, ``param_bytes``, ``optimizer_bytes``: exact, from the model's meta skeleton
  (nothing built): fp32 master weights, and AdamW's two moments plus its step counter per
  parameter tensor, which is what the runtime keeps per layer.
- ``forward_s``, ``backward_s``, ``activation_bytes``, ``boundary_bytes``: measured on this
  machine by the runtime's profiler (:func:`chameleon_elastic.runtime.profiler.profile_layers`)
  at the job's precision and micro-batch size. Decoder layers share one shape, so by default
  the embedding, the first decoder layer and the head are measured and the other decoder
  layers take the first one's figures (``--every-layer`` measures each); the file says which.

The ``[cluster]`` figures this tool cannot know (links, failure rate, restart cost) are
defaults, named as such in the file, with flags to set them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chameleon_elastic.console import CliParser, make_console

__all__ = ["JobChoice", "main", "render_job"]

_EXAMPLES = """\
examples (run from the repository root):
  chameleon-job hf tiny-llama --devices 4 -o job.toml
      2 pipelines x 2 stages for the model in tiny-llama/, measured at bf16
  chameleon-job hf tiny-llama --devices 8 --dp 2 --pp 2 --tp 2 --precision fp32 -o job.toml
      units of 2 cards (tensor parallelism by the config's base_model_tp_plan)
  chameleon-run --standalone --nproc-per-node 4 --job job.toml \\
                examples/train_hf.py --model tiny-llama --context 128

exit status:
  0  the job file was written
  2  a usage error: no config.json, an unsupported architecture, a missing extra, a layout
     that does not fit the devices (one line)
"""


@dataclass(frozen=True)
class JobChoice:
    """What the job trains with: the layout, the batch and the samples' length."""

    devices: int
    dp: int
    pp: int
    tp: int
    precision: str
    micro_batch_size: int
    global_micro_batches: int
    context: int


def layout(devices: int, layers: int, dp: int | None, pp: int | None,
           tp: int) -> tuple[int, int]:
    """``(dp, pp)``: the ones given, the other filling the units; with neither, two stages
    per pipeline where the units pair up, else one."""
    if tp < 1 or devices % tp:
        raise ValueError(f"--tp {tp} must divide --devices {devices} (a unit is tp cards)")
    units = devices // tp
    if pp is None and dp is None:
        pp = 2 if units % 2 == 0 and layers >= 2 else 1
    if pp is None:
        pp = max(1, units // dp)
    if dp is None:
        dp = max(1, units // pp)
    if dp < 1 or pp < 1 or dp * pp > units:
        raise ValueError(f"--dp {dp} x --pp {pp} units of {tp} cards do not fit in "
                         f"--devices {devices}; make dp x pp x tp <= devices")
    if pp > layers:
        raise ValueError(f"--pp {pp} stages exceed the model's {layers} layers")
    return dp, pp


def exact_bytes(numel: int, tensors: int) -> tuple[float, float]:
    """(parameter bytes, AdamW state bytes) of fp32 master weights: two moments per element
    and one fp32 step counter per tensor."""
    return 4.0 * numel, 8.0 * numel + 4.0 * tensors


def _number(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.6g}"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return _number(v)


def render_job(name: str, tables: dict[str, dict[str, Any]], comments: dict[str, str],
               header: Sequence[str]) -> str:
    """TOML text: ``header`` comment lines, then each table; ``comments`` keyed
    ``table.key`` go after their value."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines += [f"name = {_value(name)}", ""]
    for table, values in tables.items():
        lines.append(f"[{table}]")
        for key, value in values.items():
            note = comments.get(f"{table}.{key}")
            text = f"{key} = {_value(value)}"
            lines.append(f"{text}    # {note}" if note else text)
        lines.append("")
    return "\n".join(lines)


def _measured_layers(n: int, every: bool) -> list[int]:
    return list(range(n)) if every or n <= 3 else [0, 1, n - 1]


def measure(model: Any, choice: JobChoice, every: bool, repeats: int,
            console: Any) -> tuple[dict[str, list[float]], list[int], str]:
    """Per-layer times and activation / boundary bytes of every layer: measured on the layers
    :func:`_measured_layers` names (fed one another's outputs, in order), the other decoder
    layers taking the first decoder layer's figures."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from chameleon_elastic.runtime.model import PipelineModel
    from chameleon_elastic.runtime.profiler import profile_layers

    n = model.num_layers
    chosen = _measured_layers(n, every)
    view = PipelineModel(num_layers=len(chosen), build_layer=lambda j: model.build_layer(
        chosen[j]), loss=model.loss, make_optimizer=model.make_optimizer,
        sample=model.sample, seed=model.seed, dataset=model.dataset)
    last = [time.perf_counter()]

    def advance(j: int) -> None:
        bar.advance(task)
        now = time.perf_counter()
        if not console.is_terminal and now - last[0] > 1.0:   # a log: a line per slow layer
            console.print(f"chameleon-job: measured layer {chosen[j]} ({j + 1}/{len(chosen)}) "
                          f"in {now - last[0]:.1f} s", highlight=False)
        last[0] = now

    with Progress(TextColumn("measuring layers"), BarColumn(), TextColumn(
            "{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
            transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("layers", total=len(chosen))
        profile = profile_layers(view, choice.micro_batch_size, repeats=repeats, warmup=1,
                                 precision=choice.precision, progress=advance)
    figures = profile.model
    out: dict[str, list[float]] = {}
    for key in ("forward_s", "backward_s", "activation_bytes", "boundary_bytes"):
        measured = dict(zip(chosen, getattr(figures, key)))
        first_block = measured.get(1, measured[chosen[0]])
        out[key] = [measured.get(i, first_block) for i in range(n)]
    return out, chosen, profile.measured_on or "cpu"


def build_job(directory: Path, choice: JobChoice, *, every: bool = False, repeats: int = 3,
              device_memory: float | None = None, bandwidth: float = 1e9,
              failure_rate: float = 0.1, restart_s: float = 5.0, regroup_s: float = 0.3,
              console: Any = None) -> tuple[str, Any]:
    """The job file's text for the model in ``directory``, and its :class:`JobSpec`
    (validated by the spec's own parser)."""
    import torch

    from chameleon_elastic.plugins import memory_stats
    from chameleon_elastic.spec import JobSpec

    from . import hf

    model = hf.causal_lm(directory, context=choice.context)
    layers = hf.layers_of(model)
    n = model.num_layers
    dp, pp = layout(choice.devices, n, choice.dp or None, choice.pp or None, choice.tp)
    choice = replace(choice, dp=dp, pp=pp)
    skeleton = layers.skeleton
    params, optim = [], []
    for i in range(n):
        tensors = [p for path in layers.layout.parts(i)
                   for p in skeleton.get_submodule(path).parameters()]
        p_bytes, o_bytes = exact_bytes(sum(t.numel() for t in tensors), len(tensors))
        params.append(p_bytes)
        optim.append(o_bytes)
    torch.set_num_threads(1)   # as each worker trains: one thread per process
    began = time.perf_counter()
    measured, chosen, where = measure(model, choice, every, repeats,
                                      console or make_console(stderr=True))
    took = time.perf_counter() - began
    memory = device_memory or float(memory_stats().total)
    global_mb = choice.global_micro_batches or 2 * dp
    tables = {
        "model": {"layers": n, "forward_s": measured["forward_s"],
                  "backward_s": measured["backward_s"], "param_bytes": params,
                  "optimizer_bytes": optim, "activation_bytes": measured["activation_bytes"],
                  "boundary_bytes": measured["boundary_bytes"], "precision": choice.precision},
        "cluster": {"devices": choice.devices, "device_memory_bytes": memory,
                    "bandwidth_bytes_per_s": bandwidth, "restart_s": restart_s,
                    "failure_rate_per_hour": failure_rate, "regroup_s": regroup_s},
        "training": {"dp": dp, "pp": pp, **({"tp": choice.tp} if choice.tp > 1 else {}),
                     "global_micro_batches": global_mb,
                     "micro_batch_size": choice.micro_batch_size,
                     "precision": choice.precision},
    }
    rest = "decoder layer 2 takes" if n == 4 else f"decoder layers 2-{n - 2} take"
    what = "every layer" if chosen == list(range(n)) else (
        f"layers {', '.join(map(str, chosen))}; {rest} layer 1's figures, same shapes")
    header = [
        (f"written by chameleon-job hf {directory} ({layers.config.model_type}, "
         f"{sum(layers.numel(i) for i in range(n)):,} parameters, {n} layers: embedding, "
         f"{n - 2} decoder layers, norm + head)"),
        ("exact, from the model: layers, param_bytes (fp32 master weights), optimizer_bytes "
         "(AdamW: 2 moments + a step per tensor)"),
        (f"measured on this machine ({where}) by the runtime's profiler in {took:.1f} s, at "
         f"{choice.precision}, micro-batches of {choice.micro_batch_size} x "
         f"{choice.context} tokens: forward_s, backward_s, activation_bytes, boundary_bytes "
         f"({what})"),
        ("defaults, not measured: the [cluster] figures other than devices (set them with "
         "chameleon-job's flags or here)"),
        f"train with: examples/train_hf.py --model {directory} --context {choice.context}",
    ]
    comments = {"cluster.device_memory_bytes": "this host's memory" if device_memory is None
                else "", "cluster.bandwidth_bytes_per_s": "default (--bandwidth)",
                "cluster.restart_s": "default (--restart-s)",
                "cluster.failure_rate_per_hour": "default (--failure-rate)",
                "cluster.regroup_s": "default; measure with chameleon-run --profile-out"}
    text = render_job(f"hf-{directory.name}", tables, {k: v for k, v in comments.items() if v},
                      header)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    spec = JobSpec.from_dict(tomllib.loads(text), name=f"hf-{directory.name}")
    return text, spec


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    ap = CliParser(prog="chameleon-job",
                   description="Write the job file chameleon-run needs, from the model itself.",
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXAMPLES)
    sub = ap.add_subparsers(dest="kind", required=True, metavar="KIND")
    h = sub.add_parser(
        "hf", prog="chameleon-job hf", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="a Hugging Face causal LM (a save_pretrained directory)",
        description="The job file for a Hugging Face causal LM: layer count, parameter and "
                    "optimizer bytes exact from the model; per-layer times, activation and "
                    "boundary bytes measured on this machine by the runtime's profiler.",
        epilog=_EXAMPLES)
    h.add_argument("directory", metavar="DIR",
                   help="written by transformers' save_pretrained (config.json; safetensors "
                        "weights optional: random weights time the same)")
    h.add_argument("--devices", type=_positive(int), required=True,
                   help="cards the job runs on (chameleon-run's nnodes x nproc-per-node)")
    h.add_argument("--dp", type=_positive(int), default=None, help="initial pipelines")
    h.add_argument("--pp", type=_positive(int), default=None,
                   help="initial stages per pipeline (default: 2 when the units pair up)")
    h.add_argument("--tp", type=_positive(int), default=1,
                   help="cards per tensor-parallel unit (default 1)")
    h.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16",
                   help="training precision, which the layers are timed at (default bf16, "
                        "train_hf.py's)")
    h.add_argument("--micro-batch-size", type=_positive(int), default=4,
                   help="samples per micro-batch (default 4, train_hf.py's)")
    h.add_argument("--global-micro-batches", type=_positive(int), default=8,
                   help="micro-batches per step over all pipelines (default 8)")
    h.add_argument("--context", type=_positive(int), default=128,
                   help="tokens per sample, as train_hf.py --context (default 128)")
    h.add_argument("--every-layer", action="store_true",
                   help="measure every decoder layer, not only the first")
    h.add_argument("--repeats", type=_positive(int), default=3,
                   help="timed runs per layer (median; default 3)")
    h.add_argument("--device-memory", type=_positive(float), default=None,
                   help="bytes per card (default: this host's memory)")
    h.add_argument("--bandwidth", type=_positive(float), default=1e9,
                   help="bytes/s of the slowest link (default 1e9)")
    h.add_argument("--failure-rate", type=_positive(float), default=0.1,
                   help="failures per card-hour (default 0.1)")
    h.add_argument("--restart-s", type=_positive(float), default=5.0)
    h.add_argument("--regroup-s", type=_positive(float), default=0.3)
    h.add_argument("-o", "--out", required=True, metavar="FILE", help="the job file to write")
    args = ap.parse_args(argv)
    from chameleon_elastic.spec import SpecError

    from .hf import HFModelError

    console = make_console(stderr=True)
    choice = JobChoice(args.devices, args.dp or 0, args.pp or 0, args.tp, args.precision,
                       args.micro_batch_size, args.global_micro_batches, args.context)
    directory = Path(args.directory)
    try:
        text, spec = build_job(directory, choice, every=args.every_layer, repeats=args.repeats,
                               device_memory=args.device_memory, bandwidth=args.bandwidth,
                               failure_rate=args.failure_rate, restart_s=args.restart_s,
                               regroup_s=args.regroup_s, console=console)
    except (HFModelError, SpecError, ValueError) as exc:
        ap.error(str(exc))
    try:
        Path(args.out).write_text(text)
    except OSError as exc:
        ap.error(f"cannot write {args.out!r} ({exc.strerror}); pass a writable path")
    m, t = spec.model, spec.training
    print(f"wrote {args.out}: {m.layers} layers, dp {t.dp} x pp {t.pp}"
          f"{f' x tp {t.tp}' if t.tp > 1 else ''} on {spec.cluster.devices} cards, "
          f"{t.precision}, {sum(m.param_bytes) / 1e6:.1f} MB of weights; forward "
          f"{sum(m.forward_s) * 1e3:.2f} ms + backward {sum(m.backward_s) * 1e3:.2f} ms per "
          f"micro-batch (measured)")
    return 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()

