"""Checks of one value of a job file: the readers every table of ``spec`` is built with.

A job file is validated on load so that a typo fails at once with one sentence naming the key,
the value and what was expected (``SpecError``). Each reader here takes a table of plain data,
its name and a key, and returns the key's value checked against one expectation (a finite
number above a bound, an integer, a share in (0, 1], a boolean, one of some choices, a
per-layer figure: a scalar or a list of ``model.layers`` entries), or its default. They know
nothing of the dataclasses, so they sit below ``spec``: its table readers (``_parse_model``
and the others) compose them next to the dataclass each table builds, and ``JobSpec``'s own
``with_recovery`` / ``with_snapshot_every`` check a command-line flag with them as if it came
from the file. ``spec`` keeps ``SpecError`` importable, since it raises it itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["SpecError"]


class SpecError(ValueError):
    """A job spec that cannot be used; the message names the key and the fix."""


def _section(data: Mapping[str, Any], name: str, required: bool = True) -> Mapping[str, Any]:
    value = data.get(name)
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            f"section [{name}] is missing or not a table; add a [{name}] table to the job file."
        )
    return value


def _reject_unknown(section: Mapping[str, Any], name: str, known: tuple[str, ...]) -> None:
    for key in section:
        if key not in known:
            raise SpecError(
                f"unknown key {name}.{key}; the keys of [{name}] are: {', '.join(known)}."
            )


def _number(section: Mapping[str, Any], name: str, key: str, *, minimum: float = 0.0,
            strict: bool = False, default: float | None = None) -> float:
    if key not in section:
        if default is not None:
            return default
        raise SpecError(f"missing key {name}.{key}; add it to the [{name}] table.")
    value = section[key]
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < minimum or (strict and value <= minimum):
        relation = ">" if strict else ">="
        raise SpecError(
            f"{name}.{key} = {value!r} is invalid; expected a finite number {relation} {minimum:g}."
        )
    return float(value)


def _integer(section: Mapping[str, Any], name: str, key: str, *, minimum: int = 1,
             default: int | None = None) -> int:
    if key not in section:
        if default is not None:
            return default
        raise SpecError(f"missing key {name}.{key}; add it to the [{name}] table.")
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name}.{key} = {value!r} is invalid; expected an integer >= {minimum}.")
    return value


def _fraction(section: Mapping[str, Any], name: str, key: str, *, default: float) -> float:
    """A number in (0, 1]: a share of an ideal, such as a speed-up's efficiency."""
    value = section.get(key, default)
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and 0 < value <= 1)
    if not ok:
        raise SpecError(f"{name}.{key} = {value!r} is invalid; expected a number > 0 and <= 1.")
    return float(value)


def _boolean(section: Mapping[str, Any], name: str, key: str, *, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{name}.{key} = {value!r} is invalid; expected true or false.")
    return value


def _choice(section: Mapping[str, Any], name: str, key: str, allowed: tuple[str, ...], *,
            default: str) -> str:
    value = section.get(key, default)
    if value not in allowed:
        raise SpecError(
            f"{name}.{key} = {value!r} is invalid; expected one of: {', '.join(allowed)}."
        )
    return value


def _per_layer(section: Mapping[str, Any], key: str, layers: int, *,
               strict: bool) -> tuple[float, ...]:
    if key not in section:
        raise SpecError(f"missing key model.{key}; add it to the [model] table.")
    return _layer_figures(section, key, layers, strict=strict)


def _optional_per_layer(section: Mapping[str, Any], key: str, layers: int
                        ) -> tuple[float, ...] | None:
    """A per-layer byte figure that may be left out (None: the model's default applies)."""
    return _layer_figures(section, key, layers, strict=False) if key in section else None


def _layer_figures(section: Mapping[str, Any], key: str, layers: int, *,
                   strict: bool) -> tuple[float, ...]:
    value = section[key]
    relation = "> 0" if strict else ">= 0"
    expected = f"a finite number {relation} or a list of {layers} such numbers (one per layer)"
    if isinstance(value, list):
        if len(value) != layers:
            raise SpecError(
                f"model.{key} has {len(value)} entries but model.layers = {layers}; "
                f"expected {expected}."
            )
        items = value
    else:
        items = [value] * layers
    for i, item in enumerate(items):
        ok = (not isinstance(item, bool) and isinstance(item, (int, float))
              and math.isfinite(item) and (item > 0 if strict else item >= 0))
        if not ok:
            where = f"model.{key}[{i}]" if isinstance(value, list) else f"model.{key}"
            raise SpecError(f"{where} = {item!r} is invalid; expected {expected}.")
    return tuple(float(x) for x in items)
