"""CLI flags generated from the config dataclasses: one flag per field, help from metadata."""

from __future__ import annotations

import argparse
import dataclasses
import typing


def _takes(f: dataclasses.Field, command: str | None) -> bool:
    """Whether ``command``'s CLI has this field: not for keys (environment or file only), and
    only for the commands its ``commands`` metadata names, where it names any."""
    if not f.metadata.get("cli", True):
        return False
    return command is None or command in f.metadata.get("commands", (command,))


def add_config_args(parser: argparse.ArgumentParser, cls, title: str | None = None,
                    command: str | None = None) -> None:
    """One flag per field of ``cls`` that ``command`` takes (see ``_takes``)."""
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not _takes(f, command):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        # argparse formats help with %: a literal one ("past 90%") must be doubled
        help_text = (f.metadata.get("help", "") + f" (default: {f.default!r})").replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=f.default,
                               choices=f.metadata.get("choices"), help=help_text)


def config_from_args(args: argparse.Namespace, cls):
    """Build ``cls`` from parsed flags (defaults for fields this command has no flag for);
    a ``ValueError`` from validation names the problem."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.metadata.get("cli", True) and hasattr(args, f.name)})


def config_to_args(config) -> list[str]:
    """The flags that rebuild ``config`` in another process (non-default fields only)."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == f.default or not f.metadata.get("cli", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out
