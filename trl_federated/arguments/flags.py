"""What `trl-federated run` answers before TRL and torch import: the `--config` YAML (readable, a mapping), the name of
every YAML key and `--flag`, a value outside a field's choices, a value argparse cannot convert (`--num_rounds abc`),
and `--help`.

Building the run parser imports `trl.GRPOConfig`, hence transformers and torch: seconds before a typo could be named.
`known_flags` is that parser's fields and option strings, and `known_parsers.json` the parser of each algorithm
action by action (options, nargs, type, choices and help text as `--help` prints it), both written by `python -m
trl_federated.arguments.parsing` for the TRL and transformers versions `known_flags` names (tests/test_cli.py checks
them against the parser). `recorded_parser` rebuilds the parser from that record as a plain argparse parser: the same
`--help` text, the same refusal of a value it can convert. Where the installed versions differ, or
`trainer_class`/`trainer_config_class` brings fields of its own, everything is left to the parser
(`ArgumentParser`); so is a value of a type of TRL's or transformers' own, and what the configs check themselves
(`__post_init__`: `--num_rounds -1`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from .. import choices as registries
from ..names import closest_key_hint

# Keys a `--config` YAML may hold beside the fields: TRL's environment variables (`TrlParser`).
YAML_ONLY_KEYS = ("env",)


def read_yaml_config(path: str, error: Callable[[str], Any]) -> dict[str, Any]:
    """The mapping a `--config` YAML file holds; `error(message)` for a file that is missing, not YAML, or not a
    mapping."""
    try:
        with open(path, encoding="utf-8") as stream:
            values = yaml.safe_load(stream)
    except OSError as fault:
        return error(f"cannot read --config {path}: {fault.strerror or fault}.")
    except yaml.YAMLError as fault:
        return error(f"--config {path} is not valid YAML: {' '.join(str(fault).split())}")
    if values is None:
        return {}
    if not isinstance(values, dict):
        return error(f"--config {path} must hold `key: value` lines, got a {type(values).__name__}.")
    return values


def usage_error(message: str, prog: str = "trl-federated run"):
    """Stop with `prog: error: message` on one line and exit status 2, as argparse does."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def split_config(args: list[str], error: Callable[[str], Any]) -> tuple[dict[str, Any], str | None, list[str]]:
    """(the `--config` YAML's values, its path, the other arguments): `{}, None, args` without `--config`."""
    if "--config" not in args[:-1]:
        return {}, None, args
    at = args.index("--config")
    path = args[at + 1]
    return read_yaml_config(path, error), path, args[:at] + args[at + 2 :]


def check_names(
    values: dict[str, Any], path: str | None, flags: list[str], fields: Iterable[str], options: Iterable[str],
    error: Callable[[str], Any],
) -> None:
    """`error` for the first key of the `--config` YAML at `path` (its `values`) that is no field (nor
    `YAML_ONLY_KEYS`), then for the first of `flags` that is no option, in one line that names the closest valid one
    (`closest_key_hint`)."""
    fields, options = [*fields, *YAML_ONLY_KEYS], list(options)
    for key in values:
        if key not in fields:
            error(f"unknown key `{key}` in {path}.{closest_key_hint(key, fields)}")
    for token in flags:
        flag = token.partition("=")[0]
        if flag.startswith("--") and flag not in options:
            error(f"unknown flag `{flag}`.{closest_key_hint(flag, options)}")


def choice_hint(key: str, value: str, choices: Iterable[Any]) -> str:
    """What to say after a value outside a field's choices: a named method (`trl-federated compare --methods`) given
    as an `aggregation` gets the settings that make it; else the closest choice."""
    from ..methods import METHODS

    if key == "aggregation" and value in METHODS:
        method = METHODS[value]
        settings = " ".join(f"--{name} {setting}" for name, setting in method.overrides().items())
        return f" `{value}` names the method {method.display_name}; `run` takes it as `{settings}`."
    return closest_key_hint(value, map(str, choices))


def check_choices(
    values: dict[str, Any], path: str | None, flags: list[str], choices: dict[str, Iterable[Any]],
    error: Callable[[str], Any],
) -> None:
    """`error` for the first value of the `--config` YAML at `path` (its `values`), then of `flags`, outside its
    field's `choices` (by field name), in one line with `choice_hint`'s hint: argparse checks a flag's value, never a
    YAML default's, and says no more than the choices."""
    for key, value in values.items():
        if key in choices and value is not None and str(value) not in map(str, choices[key]):
            error(f"`{key}: {value}` in {path} is not one of {list(choices[key])}."
                  f"{choice_hint(key, str(value), choices[key])}")
    for index, token in enumerate(flags):
        flag, _, value = token.partition("=")
        key = flag[2:]
        if key in choices and not value and index + 1 < len(flags):
            value = flags[index + 1]
        if key in choices and value and value not in map(str, choices[key]):
            hint = choice_hint(key, value, choices[key])  # argparse's own words, with the hint it lacks
            error(f"argument {flag}: invalid choice: {value!r} (choose from {', '.join(map(repr, choices[key]))})."
                  f"{hint}")


def setting(args: list[str], name: str, default):
    """`--name value` from `args`, else `name:` from the `--config` YAML, else `default`; read before parsing, for the
    settings that decide which config class parses the rest (`parsing.config_class`)."""
    value = default
    if "--config" in args[:-1]:
        value = read_yaml_config(args[args.index("--config") + 1], usage_error).get(name, value)
    if f"--{name}" in args[:-1]:
        value = args[args.index(f"--{name}") + 1]
    return value


def installed_versions() -> tuple[str, str]:
    """The versions of TRL and transformers installed, whose dataclasses hold most of the run parser's fields."""
    return metadata.version("trl"), metadata.version("transformers")


# Each algorithm's run parser, action by action (`parsing.known_parsers_source`), for `known_flags.VERSIONS`.
KNOWN_PARSERS = Path(__file__).with_name("known_parsers.json")


class _Deferred(Exception):
    """A value of a type `recorded_parser` does not hold (one of TRL's or transformers' own): left to the parser."""


def _deferred(value: str):
    raise _Deferred(value)


BUILTIN_TYPES = {"int": int, "float": float, "str": str}


def recorded_type(name: str | None, choices: list | None) -> Callable[[str], Any] | None:
    """The type of an action that `known_parsers.json` names (`parsing._type_name`): one of `BUILTIN_TYPES`; None (no
    conversion); a converter of TRL's parser (`trl.scripts._hf_argparser`): `string_to_bool` ("bool"), `_accept_none`
    around a builtin or "bool" ("int or none", a `T | None` field) or `make_choice_type_function` of the action's
    `choices` ("choice"), imported when it first converts a value (about 0.1 s: TRL's lazy package, neither torch nor
    transformers); or for "other", one that leaves the value to the parser (`_Deferred`)."""
    if name is None or name in BUILTIN_TYPES:
        return BUILTIN_TYPES.get(name)
    if name == "other":
        return _deferred
    inner_name, _, or_none = name.partition(" or ")

    def convert(value: str):
        from trl.scripts import _hf_argparser

        if name == "choice":
            return _hf_argparser.make_choice_type_function(choices)(value)
        inner = _hf_argparser.string_to_bool if inner_name == "bool" else BUILTIN_TYPES[inner_name]
        return (_hf_argparser._accept_none(inner) if or_none else inner)(value)

    # argparse names a type that raises ValueError by its __name__: the parser's converter's
    convert.__name__ = {"bool": "string_to_bool", "choice": "<lambda>"}.get(inner_name, inner_name)
    return convert


class RecordedParser(argparse.ArgumentParser):
    """The run parser as `known_parsers.json` records it, built without TRL (`recorded_parser`); one-line errors as
    `ArgumentParser`'s."""

    def error(self, message: str):
        usage_error(message, self.prog)


@functools.cache
def _known_parsers() -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError):
        return json.loads(KNOWN_PARSERS.read_text(encoding="utf-8"))
    return None


def recorded_parser(algorithm: str) -> RecordedParser | None:
    """The run parser of `algorithm` rebuilt from `known_parsers.json` (None for an algorithm it does not record, or
    once a name of a registry that gives a field its choices, `choices.AGGREGATIONS`, is registered in this process):
    the same groups in the same order, the same actions (options, nargs, const, choices, metavar) in the same order,
    each help text as the parser's `ArgumentDefaultsHelpFormatter` expands it, so that `format_help` is the parser's
    (tests/test_cli.py); each type as `recorded_type` rebuilds it."""
    known = _known_parsers()
    if known is None or not isinstance(algorithm, str) or algorithm not in known["parsers"]:
        return None
    recorded = known["parsers"][algorithm]
    parser = RecordedParser(prog=known["prog"], usage=known["usage"], description=known["description"],
                            epilog=known["epilog"], add_help=False, allow_abbrev=False)
    builtin = {"positionals": parser._positionals, "optionals": parser._optionals}
    groups = []
    for title, description, kind in recorded["groups"]:
        group = builtin[kind] if kind else parser.add_argument_group()
        group.title, group.description = title, description
        groups.append(group)
    parser._action_groups[:] = groups  # in the recorded order, the parser's after its sort
    for record, group in recorded["actions"]:
        kind, options, dest, nargs, const, type_name, choices, registry, required, metavar, help_text = (
            known["actions"][record]
        )
        if registry is not None and set(getattr(registries, registry).names_so_far()) - set(choices):
            return None  # a name registered in this process (an aggregation of one's own): the parser's choices
        if help_text == argparse.SUPPRESS:
            help_text = argparse.SUPPRESS  # argparse compares it by identity
        elif help_text is not None:
            help_text = help_text.replace("%", "%%")  # expanded already: printed as it is
        settings = {"dest": dest, "required": required, "help": help_text}
        if kind == "store":
            settings |= {"nargs": nargs, "type": recorded_type(type_name, choices), "choices": choices,
                         "metavar": metavar}
        if kind in ("store", "store_const") and const is not None:
            settings["const"] = const
        if kind == "help":
            settings = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text}
        groups[group].add_argument(*options, action=kind, **settings)
    return parser


def check_before_import(args: list[str]) -> None:
    """`usage_error` for a `--config` YAML that cannot be read, and, where `known_flags` holds the installed versions'
    fields, for an unknown key or flag, a value outside its field's choices and a value the recorded parser refuses
    (`recorded_parser`), and `--help` printed from the record: what `ArgumentParser` answers first, without importing
    torch or transformers (nor TRL, but its lazy package for a bool, `T | None` or enum value, `recorded_type`).
    Returns where the record cannot tell: the parser then parses as ever."""
    from . import known_flags

    values, path, flags = split_config(args, usage_error)
    # A trainer or config class of its own may bring fields of its own (RLOO's `normalize_advantages`).
    custom_fields = any(
        name in values or f"--{name}" in flags for name in ("trainer_class", "trainer_config_class")
    )
    if installed_versions() != known_flags.VERSIONS or custom_fields:
        return
    check_names(values, path, flags, known_flags.FIELDS, known_flags.OPTIONS, usage_error)
    parser = recorded_parser(setting(args, "algorithm", "grpo"))
    if parser is None or "--config" in flags:  # an algorithm the parser refuses; a `--config` without its file
        return
    choices = {action.dest: action.choices for action in parser._actions if action.choices is not None}
    check_choices(values, path, flags, choices, usage_error)
    if values and {"-h", "--help"} & set(flags):
        return  # the parser's --help shows the YAML's values as the defaults
    for action in parser._actions:  # the YAML's values as the defaults, as TrlParser sets them
        if action.dest in values:
            action.default, action.required = values[action.dest], False
    with contextlib.suppress(_Deferred):  # the help (exit 0) or one line (exit 2); else the parser parses
        parser.parse_known_args(flags)
