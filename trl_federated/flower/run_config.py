"""A Flower app's run config (`[tool.flwr.app.config]`, `flwr run --run-config "key=value ..."`) as the arguments of
`trl-federated run`: `FedGRPOConfig` (or the DAPO/GSPO recipe), TRL's `ModelConfig` and `BenchmarkArguments`.

Mapping rule: every flag `--some_field` of `trl-federated run` is the run-config key `some-field` (Flower's flat
kebab-case keys, as in FlowerTune): `num-rounds`, `local-steps`, `learning-rate`, `lora-r`, `aggregation`, ...,
derived from the dataclass fields, plus `num-server-rounds`, the name Flower's templates give `num_rounds`. Not
keys: `federation_round` (set by the federation) and `resume_from_checkpoint` (an app's `resume` key). A list field
takes its items comma-separated (`reward-funcs="accuracy,format"`). The value "" leaves a field unset: to the YAML
base (the run-config key `config`, optional) or to its default, also where the default derives from other fields
(`server_learning_rate`, `num_clients` under the Simulation Engine). Values are parsed and checked exactly as
`trl-federated run` parses its flags (`parse_run_args`), so a value of the wrong type or out of range is refused with
the key named; so is a key that is none of these, with the closest key suggested.

Flower accepts a `--run-config` key only where the app's pyproject.toml declares it: an app declares the keys it sets,
with their values, and those its users should set at launch. `python -m trl_federated.flower.run_config` prints the
`[tool.flwr.app.config]` line of every key, to copy from.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from trl import ModelConfig

from ..arguments import BenchmarkArguments, parse_run_args
from ..config import FedGRPOConfig
from ..names import closest_key_hint

# The run-config key of the YAML base, relative to the app folder or absolute; "" for none.
CONFIG_KEY = "config"
# Flower's conventional name for the number of rounds (`flwr new` templates): an alias of `num-rounds`.
ALIASES = {"num-server-rounds": "num_rounds"}
# Fields that are no run-config keys: set by the federation, or by an app's own key (`resume`).
NOT_KEYS = frozenset({"federation_round", "resume_from_checkpoint"})
# Simulated SuperNodes (and SuperNodes that set it) carry the federation's size in their node config.
NUM_PARTITIONS = "num-partitions"


class FederationSizeError(ValueError):
    """`num_clients` differs from the number of SuperNodes the federation has."""


def run_config_key(field_name: str) -> str:
    return field_name.replace("_", "-")


def _fields() -> dict[str, dataclasses.Field]:
    """The run-config-settable fields of the three argument groups, by field name."""
    fields = {}
    for dataclass_type in (FedGRPOConfig, ModelConfig, BenchmarkArguments):
        for item in dataclasses.fields(dataclass_type):
            if item.init and item.name not in NOT_KEYS:
                fields.setdefault(item.name, item)
    return fields


def run_config_keys() -> list[str]:
    """Every run-config key that sets a field, in dataclass order (the alias `num-server-rounds` left out)."""
    return [run_config_key(name) for name in _fields()]


def _field_of(key: str, fields: Mapping[str, dataclasses.Field]) -> str:
    if key in ALIASES:
        return ALIASES[key]
    name = key.replace("-", "_")
    if name in fields and run_config_key(name) == key:  # `num_rounds` is no key: Flower's keys are kebab-case
        return name
    candidates = [run_config_key(field_name) for field_name in fields] + list(ALIASES)
    raise ValueError(
        f"Unknown run-config key `{key}`: it is no field of FedGRPOConfig, ModelConfig or BenchmarkArguments "
        f"(keys are the field names in kebab-case, e.g. `num-rounds`, `learning-rate`, `lora-r`)."
        f"{closest_key_hint(key, candidates)}"
    )


def _is_list_field(item: dataclasses.Field) -> bool:
    annotation = item.type
    if isinstance(annotation, str):  # a module with `from __future__ import annotations`
        return any(part.strip().startswith("list[") for part in annotation.split("|"))
    origins = {typing.get_origin(annotation), *(typing.get_origin(arg) for arg in typing.get_args(annotation))}
    return list in origins


def _flag_values(value, item: dataclasses.Field) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, str) and _is_list_field(item):
        return [part.strip() for part in value.split(",") if part.strip()]
    return [str(value)]


def yaml_base(run_config: Mapping, app_dir: str | Path) -> Path | None:
    """The YAML base the run config names (`config`, relative to `app_dir`), or None."""
    name = run_config.get(CONFIG_KEY, "")
    if not name:
        return None
    path = Path(app_dir) / str(name)
    if not path.is_file():
        raise FileNotFoundError(f"The run config's `{CONFIG_KEY}` names {path}, which is no file.")
    return path


def federation_arguments(
    run_config: Mapping,
    app_dir: str | Path,
    app_keys: Iterable[str] = (),
    federation_size: int | None = None,
) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """The arguments of `trl-federated run` that a run config gives: the YAML base (`config`), then every other
    key not in `app_keys` as the flag of its field (see the module docstring).

    Args:
        run_config: Flower's fused run config (`context.run_config`).
        app_dir: The folder `config` is relative to (the app's).
        app_keys: The app's own keys, read by the app itself (e.g. `resume`, `clients-file`).
        federation_size: The number of SuperNodes of the federation where known (the Simulation Engine's
            `num-partitions`): `num_clients` follows it unless the YAML or the run config sets it, and a set value
            that differs is a `FederationSizeError` naming both numbers.
    """
    fields = _fields()
    base = yaml_base(run_config, app_dir)
    argv = [] if base is None else ["--config", str(base)]
    flags: dict[str, str] = {}  # field name -> run-config key
    app_keys = set(app_keys)
    for key, value in run_config.items():
        if key == CONFIG_KEY or key in app_keys:
            continue
        name = _field_of(key, fields)
        if isinstance(value, str) and value == "":
            continue
        if name in flags:
            raise ValueError(f"Run-config keys `{flags[name]}` and `{key}` both set `{name}`; keep one.")
        flags[name] = key
        argv += [f"--{name}", *_flag_values(value, fields[name])]

    if federation_size is not None:
        yaml_values = (yaml.safe_load(base.read_text(encoding="utf-8")) or {}) if base is not None else {}
        if "num_clients" in flags:
            where, configured = f"run-config key `{flags['num_clients']}`", run_config[flags["num_clients"]]
        elif "num_clients" in yaml_values:
            where, configured = f"`num_clients` in {base.name}", yaml_values["num_clients"]
        else:
            where = configured = None
        if where is None:
            argv += ["--num_clients", str(federation_size)]
        elif str(configured) != str(federation_size):
            raise FederationSizeError(
                f"The federation has {federation_size} SuperNodes (num-partitions; in simulation "
                f"`--federation-config num-supernodes={federation_size}`), but {where} asks for {configured} "
                "clients: make them agree, or leave `num-clients` out so that it follows the federation."
            )
    return parse_arguments(argv, flags)


def parse_arguments(argv: list[str], flags: Mapping[str, str]) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """`parse_run_args(argv)`, with every refusal a ValueError that names the run-config key rather than the flag
    (argparse would print to stderr and exit)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_run_args(argv)
    except SystemExit:
        message = (stderr.getvalue().strip().splitlines() or ["invalid arguments"])[-1]
        message = re.sub(r"^.*?error: ", "", message)
    except (TypeError, ValueError) as error:  # the configs' own checks (`FedGRPOConfig.__post_init__`)
        message = str(error)
    for name, key in flags.items():
        if name != key:
            message = message.replace(f"`{name}`", f"`{name}` (run-config key `{key}`)")
        message = re.sub(rf"--{name}(/--{re.escape(key)})?(?![\w-])", f"run-config key `{key}`", message)
    raise ValueError(f"Invalid run config: {message}")


def pyproject_lines() -> list[str]:
    """A `[tool.flwr.app.config]` line for every key, unset (""), for an app to declare with its own values."""
    return [f'{key} = ""' for key in run_config_keys()]


if __name__ == "__main__":
    argparse.ArgumentParser(
        prog="python -m trl_federated.flower.run_config",
        description="Print a [tool.flwr.app.config] line for every run-config key, unset (\"\"): an app's "
        "pyproject.toml declares, with their values, the keys it sets and those `flwr run --run-config` may set.",
    ).parse_args()
    print("\n".join(pyproject_lines()))
