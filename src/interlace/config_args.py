"""Command-line options generated from a settings dataclass, and the dataclass built back.

Each field declared with `option(default, help, ...)` becomes one option named after it
(`global_batch` → `--global-batch`), with the field's default and help and a type read from its
annotation:

- int, float, str: one value of that type; `X | None` the same, defaulting to None;
- bool: the pair `--name` / `--no-name`;
- `tuple[X, ...]`: a comma-separated list of X, e.g. `3,3,2`.

`add_dataclass_args` declares the options on a parser and `dataclass_from_args` builds the
dataclass from the parsed namespace, so a field is described once, beside its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

_ITEMS = {int: "integers", float: "numbers", str: "names"}


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] = (),
    metavar: str | None = None,
    flag: str | None = None,
    aliases: Sequence[str] = (),
) -> Any:
    """A dataclass field with `default` that `add_dataclass_args` turns into an option.

    `help` says what the field means; `choices` limits its values; `metavar` names its value in
    the help; `flag` replaces the option name derived from the field's (for a bool, the name
    whose `--no-` form turns it off); `aliases` are further names of the same option.
    """
    metadata = {
        "help": help,
        "choices": tuple(choices),
        "metavar": metavar,
        "flag": flag,
        "aliases": tuple(aliases),
    }
    return dataclasses.field(default=default, metadata=metadata)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Declare one option per field of the dataclass `cls` on `parser` (the module docstring)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        flag = meta.get("flag") or "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        settings: dict[str, Any] = {"dest": field.name, "default": field.default}
        if kind is bool:
            settings["action"] = argparse.BooleanOptionalAction
        else:
            settings["type"] = _converter(kind, field.name)
            settings["metavar"] = meta.get("metavar")
            settings["choices"] = meta.get("choices") or None
        parser.add_argument(flag, *meta.get("aliases", ()), help=meta["help"], **settings)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """An instance of the dataclass `cls` from the options `add_dataclass_args` declared."""
    return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


def _converter(kind: Any, name: str) -> Callable[[str], Any]:
    """The argparse `type` for a field annotated `kind`: X, `X | None` or `tuple[X, ...]`."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType) and len(args) == 2 and type(None) in args:
        return _converter(next(a for a in args if a is not type(None)), name)
    if typing.get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _comma_list(args[0])
    if kind in _ITEMS:
        return kind
    raise TypeError(f"field {name!r}: no command-line form for the annotation {kind!r}")


def _comma_list(item: type) -> Callable[[str], tuple]:
    """Parser of 'a,b,c' into a tuple of `item`s; ArgumentTypeError on an empty or bad item."""

    def parse(text: str) -> tuple:
        parts = [part.strip() for part in text.split(",")]
        try:
            if all(parts):
                return tuple(item(part) for part in parts)
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {_ITEMS[item]}")

    return parse
