"""A run's settings as a TOML file: `interlace train --config run.toml` reads one, and every run
folder keeps its resolved settings as `config.toml`, from which the run can be repeated
(`--config runs/x/config.toml --out runs/y`) and from which `--resume` takes them.

A file holds TrainConfig fields by name, `plan` (a plan text such as "dp=2,tp=2", or a `[plan]`
table of Plan fields, the overlap options by their own names) and the run's options `nproc` and
`max_restarts`. Every key and value is checked before anything starts; options given on the
command line win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import tomllib
import types
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from interlace import __version__
from interlace.errors import ConfigError
from interlace.plan import Overlap, Plan
from interlace.run_folder import write_atomic
from interlace.train_config import TrainConfig

CONFIG_FILE = "config.toml"
"""The file in a run folder that holds the run's resolved settings."""

_KINDS = {**typing.get_type_hints(TrainConfig), "nproc": int, "max_restarts": int}
_CHOICES = {field.name: field.metadata["choices"] for field in dataclasses.fields(TrainConfig)}
_PLAN_KINDS = {
    **{k: v for k, v in typing.get_type_hints(Plan).items() if k != "overlap"},
    **typing.get_type_hints(Overlap),
}
_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_ITEMS = {int: "integers", float: "numbers", str: "strings"}


def read_config(path: str | Path) -> dict[str, Any]:
    """The settings of the TOML file `path`, each value checked against its field's type (an
    integer where a number is due read as a float, an array as a tuple) and choices; `plan` is
    kept as the text or table given. ConfigError, one line naming the key, the value and what
    is valid, for an unreadable or malformed file, an unknown key or a wrong value."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    settings: dict[str, Any] = {}
    for key, value in data.items():
        if key == "plan":
            settings[key] = _plan_value(path, value)
        elif key in _KINDS:
            settings[key] = _checked(path, key, value, _KINDS[key], _CHOICES.get(key, ()))
        else:
            raise _unknown(path, key, key, value, [*_KINDS, "plan"])
    return settings


def plan_text(plan: str | dict[str, Any]) -> str:
    """A file's `plan` as `Plan.parse` reads it: a text as it is, a table as 'key=value,...'
    (tp3d as 2x2x1, booleans in lower case, unset values left out)."""
    if isinstance(plan, str):
        return plan
    return ",".join(
        f"{key}={_plan_item(value)}" for key, value in plan.items() if value is not None
    )


def given_options(add_args: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> set[str]:
    """The options (by dest) that `argv` gives, of those `add_args` declares on a parser.

    `argv` is parsed again into a namespace in which every option is already set, so argparse
    fills in no default and an option still holding that value was not given, even one given
    at its default value."""
    parser = argparse.ArgumentParser()
    add_args(parser)
    unset = object()
    namespace = argparse.Namespace(**dict.fromkeys(vars(parser.parse_args([])), unset))
    parser.parse_args(argv, namespace)
    return {name for name, value in vars(namespace).items() if value is not unset}


def apply_settings(
    args: argparse.Namespace, settings: dict[str, Any], keep: Collection[str]
) -> None:
    """Set the attributes of `args` from `settings` (`read_config`'s, the plan as its text),
    except the names in `keep` (what the command line or a file above gave)."""
    for key, value in settings.items():
        if key not in keep:
            setattr(args, key, plan_text(value) if key == "plan" else value)


def resolved_settings(config: TrainConfig, plan: Plan, max_restarts: int) -> dict[str, Any]:
    """A run's settings as its config.toml holds them: every TrainConfig field, `nproc` (the
    plan's world size), `max_restarts`, and `plan` as a table of every field."""
    table = {k: v for k, v in dataclasses.asdict(plan).items() if k != "overlap"}
    table |= dataclasses.asdict(plan.overlap)
    return {
        **config.to_dict(),
        "nproc": plan.world_size,
        "max_restarts": max_restarts,
        "plan": table,
    }


def write_config(file: Path, settings: dict[str, Any]) -> None:
    """Write `settings` (`resolved_settings`) to `file` atomically, under a comment naming the
    interlace and torch versions."""
    versions = f"interlace {__version__}, torch {torch.__version__}"
    write_atomic(file, to_toml(settings, f"the resolved settings of an interlace run ({versions})"))


def describe_changes(saved: dict[str, Any], now: dict[str, Any], source: Path) -> str:
    """One line saying how a resumed run's settings `now` (`resolved_settings`) differ from
    `saved`, read from its config.toml `source`; plans are compared as the Plans they resolve
    to, and `out` not at all (the run is where its file was found, moved or not)."""
    changed = []
    for key, value in now.items():
        if key == "out":
            continue
        old = saved.get(key)
        if key == "plan":
            old = Plan.parse_for(plan_text(old or ""), saved.get("nproc", 1))
            value = Plan.parse(plan_text(value))
        if old != value:
            changed.append(f"{key} {_shown(old)} -> {_shown(value)}")
    what = f"changed: {', '.join(changed)}" if changed else "nothing changed"
    return f"resuming with the settings of {source}; {what}"


def to_toml(settings: dict[str, Any], comment: str) -> str:
    """TOML text of `settings` under the line `# comment`: the plain values first, then each
    dict value as a `[table]`; a None value, which TOML cannot hold, as a `# key: unset`
    comment (read back, the field keeps its default).

    Hand-written because the standard library reads TOML (tomllib) but writes none, and the
    flat values of a run's settings (str, int, float, bool and tuples of them) need only this
    much rather than another dependency."""
    tables = {key: value for key, value in settings.items() if isinstance(value, dict)}
    plain = {key: value for key, value in settings.items() if key not in tables}
    lines = [f"# {comment}", *_assignments(plain)]
    for name, table in tables.items():
        lines += ["", f"[{name}]", *_assignments(table)]
    return "\n".join(lines) + "\n"


def _assignments(values: dict[str, Any]) -> list[str]:
    return [f"{k} = {_toml(v)}" if v is not None else f"# {k}: unset" for k, v in values.items()]


def _toml(value: Any) -> str:
    """`value` in TOML: a bool, int, float (repr: round-trips, inf and nan included), string or
    tuple/list of them; anything else (a date or table, in messages only) as its str()."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return str(value)


def _string(text: str) -> str:
    """`text` as a TOML basic string: quote and backslash escaped, control characters as
    unicode escapes."""
    escaped = (
        "\\" + ch if ch in '"\\' else f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ch == "\x7f" else ch
        for ch in text
    )
    return '"' + "".join(escaped) + '"'


def _shown(value: Any) -> str:
    return "unset" if value is None else _toml(value)


def _plan_item(value: Any) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return _toml(value) if isinstance(value, bool) else str(value)


def _plan_value(path: Path, value: Any) -> str | dict[str, Any]:
    """The file's `plan`: a text as it is, a table with each value checked."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ConfigError(
            f'{path}: plan = {_toml(value)} is neither a plan text such as "dp=2,tp=2" nor a '
            "[plan] table of plan fields"
        )
    table = {}
    for key, item in value.items():
        if key not in _PLAN_KINDS:
            raise _unknown(path, f"plan.{key}", key, item, list(_PLAN_KINDS))
        table[key] = _checked(path, f"plan.{key}", item, _PLAN_KINDS[key])
    return table


def _checked(path: Path, name: str, value: Any, kind: Any, choices: tuple[str, ...] = ()) -> Any:
    """`value` of the key `name` as its field (annotated `kind`) holds it; ConfigError for
    another type or a value outside `choices`."""
    typed = _typed(value, kind)
    if typed is None:
        raise ConfigError(f"{path}: {name} = {_toml(value)} is not {_describe(kind)}")
    if choices and typed not in choices:
        raise ConfigError(f"{path}: {name} = {_toml(value)} is not one of {', '.join(choices)}")
    return typed


def _typed(value: Any, kind: Any) -> Any:
    """`value` as a field annotated `kind` (X, `X | None`, `tuple[X, ...]`, `tuple[X, X]`)
    holds it, or None if it has another type (a bool is no integer)."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType):  # X | None: TOML has no null, so an X
        return _typed(value, next(a for a in args if a is not type(None)))
    if typing.get_origin(kind) is tuple:
        if not isinstance(value, list):
            return None
        kinds = args[:1] * len(value) if args[-1:] == (Ellipsis,) else args
        items = [_typed(item, k) for item, k in zip(value, kinds, strict=False)]
        return tuple(items) if len(value) == len(kinds) and None not in items else None
    if kind is float and type(value) is int:
        return float(value)
    return value if type(value) is kind else None


def _describe(kind: Any) -> str:
    """What a value of a field annotated `kind` must be, e.g. 'an array of 3 integers'."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType):
        return _describe(next(a for a in args if a is not type(None)))
    if typing.get_origin(kind) is tuple:
        count = "" if args[-1:] == (Ellipsis,) else f"{len(args)} "
        return f"an array of {count}{_ITEMS[args[0]]}"
    return _NAMES[kind]


def _unknown(path: Path, name: str, key: str, value: Any, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(
        f"{path}: unknown key '{name}' = {_toml(value)}{hint}; valid keys: {', '.join(valid)}"
    )
