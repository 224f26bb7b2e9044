"""What `trl-federated run` checks of its arguments before TRL and torch import: the `--config` YAML (readable, a
mapping) and the name of every YAML key and `--flag`, against the run parser's fields as `known_flags` records them.

Building the run parser imports `trl.GRPOConfig`, hence transformers and torch: seconds before a typo could be named.
`known_flags` is that parser's fields and option strings, written by `python -m trl_federated.arguments.parsing` for
the TRL and transformers versions it names (tests/test_cli.py checks it against the parser); where the installed
versions differ, or `trainer_class`/`trainer_config_class` brings fields of its own, the names are left to the parser
(`ArgumentParser`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any

import yaml

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


def installed_versions() -> tuple[str, str]:
    """The versions of TRL and transformers installed, whose dataclasses hold most of the run parser's fields."""
    return metadata.version("trl"), metadata.version("transformers")


def check_before_import(args: list[str]) -> None:
    """`usage_error` for a `--config` YAML that cannot be read, and, where `known_flags` holds the installed versions'
    fields, for an unknown key or flag: what `ArgumentParser` refuses first, without importing TRL or torch."""
    from . import known_flags

    values, path, flags = split_config(args, usage_error)
    # A trainer or config class of its own may bring fields of its own (RLOO's `normalize_advantages`).
    custom_fields = any(
        name in values or f"--{name}" in flags for name in ("trainer_class", "trainer_config_class")
    )
    if installed_versions() == known_flags.VERSIONS and not custom_fields:
        check_names(values, path, flags, known_flags.FIELDS, known_flags.OPTIONS, usage_error)
