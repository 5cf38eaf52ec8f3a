"""Config dataclasses as command-line options: every field a flag, the dataclass the only source
of defaults. The `lumen`, `replay` and bench commands all build their options here."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

from engine.config import EngineConfig


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    *,
    skip: tuple[str, ...] = (),
    only_given: bool = False,
) -> None:
    """One flag per field of a config dataclass; the dataclass is the only source of defaults.

    ``only_given``: a flag the user did not give is left out of the parsed arguments (and of
    ``options``), so the caller can take its value from elsewhere, such as a recording.
    """
    hints = get_type_hints(cls)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        default = argparse.SUPPRESS if only_given else f.default
        if get_origin(typ) is tuple:  # a list of values, as vLLM's nargs="+" flags
            group.add_argument(
                flag, nargs="+", default=default, help=help_text, metavar=f.name.upper()
            )
        elif typ is bool and f.name.startswith("no_"):
            group.add_argument(flag, action="store_true", help=help_text, default=default)
        elif typ is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            group.add_argument(
                flag, type=typ, default=default, help=help_text, metavar=f.name.upper()
            )


def add_engine_options(
    parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = (), only_given: bool = False
) -> None:
    add_options(parser, EngineConfig, "engine options", skip=skip, only_given=only_given)


def options(cls: type, args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        f.name: tuple(v) if isinstance(v := getattr(args, f.name), list) else v
        for f in dataclasses.fields(cls)
        if f.name not in skip and hasattr(args, f.name)
    }


def engine_options(args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return options(EngineConfig, args, skip=skip)


def _base_type(hint: Any) -> type:
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def option_flags(config: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that make ``config`` (a config dataclass): one per field that
    differs from its default, so ``lumen serve`` can be started as a config says."""
    flags: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
