"""Command-line options generated from a dataclass: one field, one flag.

``ServerArgs`` (``radixserve serve``) and ``RouterArgs`` (``radixserve router``)
declare their fields with ``flag(help, default=...)`` and inherit ``CliArgs``;
the option's type, choices and default come from the field's resolved annotation.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T", bound="CliArgs")
# The kind of a ``list[list[str]]`` field: each use of its flag adds one list (``--prefill URL PORT``).
NESTED = "a list per use"


def flag(help: str, **kw: Any) -> Any:
    """A dataclass field with its command-line help; ``aliases`` adds other spellings,
    ``cli_names`` replaces the generated one."""
    default = kw.pop("default")
    meta = {"help": help, **kw}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class CliArgs:
    """Adds the command-line form to a dataclass whose fields are made with ``flag``."""

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # every user is a dataclass

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One option per field, typed from the field's resolved annotation (``cli_type``): a
        bool is ``--flag`` / ``--no-flag``, a ``Literal`` lists its choices, ``Optional[X]``
        parses as ``X``, ``list[str]`` takes any number of values."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every user is a dataclass
            flags = list(f.metadata.get("cli_names", ["--" + f.name.replace("_", "-")]))
            flags += f.metadata.get("aliases", ())  # e.g. SGLang's spelling of the same flag
            default = field_default(cls.__name__, f)
            kind, choices = cli_type(cls.__name__, f.name, hints[f.name])
            if kind is bool:
                # --x sets True, --no-x False; a default of None (unset) leaves the choice to the program.
                parser.add_argument(
                    *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"]
                )
                continue
            if kind is NESTED:  # each use of the flag adds one list of values
                parser.add_argument(
                    *flags,
                    dest=f.name,
                    action="append",
                    nargs="+",
                    default=default,
                    metavar=f.metadata.get("metavar"),
                    help=f"{f.metadata['help']} (repeatable; default: {default})",
                )
                continue
            repeat = kind is list and f.metadata.get("repeat", False)  # each use adds its values
            parser.add_argument(
                *flags,
                dest=f.name,
                type=str if kind is list else kind,
                nargs=("+" if repeat else "*") if kind is list else None,
                action="extend" if repeat else "store",
                default=default,
                choices=choices,
                metavar=f.metadata.get("metavar"),
                help=f"{f.metadata['help']} ({'repeatable; ' if repeat else ''}default: {default})",
            )

    @classmethod
    def from_cli_args(cls: type[T], ns: argparse.Namespace) -> T:
        return cls(**{name: getattr(ns, name) for name in cls.field_names()})


def field_default(owner: str, f: dataclasses.Field[Any]) -> Any:
    """The default value of a field (every field of a ``CliArgs`` dataclass has one)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{owner}.{f.name} has no default")


def cli_type(owner: str, name: str, hint: Any) -> tuple[Any, tuple[Any, ...] | None]:
    """The argparse type, and the choices (None: any value), of the field ``owner.name``
    whose resolved annotation is ``hint``: ``Optional[X]`` (or ``X | None``) is ``X`` (None
    stays the default's); ``Literal[...]`` of one type is that type with its values as
    choices; ``list[str]`` is ``list`` (values are strings; ``flag(repeat=True)`` lets its
    flag be given several times), ``list[list[str]]`` is ``NESTED``; ``bool``, ``int``, ``float``
    and ``str`` are themselves. Any other annotation has no command-line form, and is a
    TypeError naming the field."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) != 1:
            raise TypeError(f"{owner}.{name}: no command-line form for the union {hint}")
        hint = members[0]
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        kinds = {type(value) for value in values}
        if len(kinds) != 1 or bool in kinds:
            raise TypeError(f"{owner}.{name}: no command-line form for {hint} (values of one type: str, int or float)")
        return kinds.pop(), values
    if typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        return list, None
    if typing.get_origin(hint) is list and typing.get_args(hint) == (list[str],):
        return NESTED, None
    if hint in (bool, int, float, str):
        return hint, None
    raise TypeError(f"{owner}.{name}: no command-line form for {hint}")
