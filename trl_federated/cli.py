"""`trl-federated` command line: `trl-federated run --config examples/configs/quickstart.yaml [--key value ...]`.

Arguments parse like TRL's own scripts (`TrlParser`): a YAML file, overridden by `--key value` flags, filling a
`FedGRPOConfig` (training and federation), a `ModelConfig` (model and LoRA) and `BenchmarkArguments` (data).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import logging
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from .config import CONFIG_CLASSES, FedGRPOConfig, federated_config

logger = logging.getLogger("trl_federated")

REWARD_FUNCTIONS = ("accuracy", "format")
# TRL's `trl grpo` reward names (`trl/scripts/grpo.py`), with the values that script gives them: TRL's functions, which
# read the dataset's `solution` column, as in `trl grpo`.
TRL_REWARD_FUNCTIONS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                        "get_soft_overlong_punishment")  # fmt: skip
# Arguments of TRL's scripts (`ScriptArguments`, `DatasetMixtureConfig`) that this package does not take, with what to
# use instead: an unknown key or flag of that name gets this advice rather than the closest spelling.
TRL_SCRIPT_EQUIVALENTS = {
    "dataset_streaming": "A federation partitions every client's rows before training, so it cannot stream the "
    "dataset: drop `dataset_streaming`.",
    "datasets": "TRL's dataset mixtures are not supported: give one dataset as `dataset_name` (with "
    "`dataset_config` and the `dataset_*_split` fields).",
    "streaming": "A federation partitions every client's rows before training, so it cannot stream the dataset.",
    "test_split_size": "Give the evaluation rows as a split of `dataset_name`, named by `dataset_test_split`.",
}


def closest_key_hint(key: str, candidates: Iterable[str]) -> str:
    """What to say after "unknown key `key`": for an argument of TRL's scripts that this package does not take, its
    equivalent (`TRL_SCRIPT_EQUIVALENTS`); else " Did you mean `<the closest candidate>`?" (difflib), or "" when none
    is close. One helper for the YAML keys and flags of `trl-federated run` and for a Flower app's run-config keys."""
    equivalent = TRL_SCRIPT_EQUIVALENTS.get(key.lstrip("-").replace("-", "_"))
    if equivalent is not None:
        return f" {equivalent}"
    close = difflib.get_close_matches(key, list(candidates), n=1)
    return f" Did you mean `{close[0]}`?" if close else ""


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


def choice_hint(key: str, value: str, choices: Iterable[Any]) -> str:
    """What to say after a value outside a field's choices: a named method (`trl-federated compare --methods`) given
    as an `aggregation` gets the settings that make it; else the closest choice."""
    from .methods import METHODS

    if key == "aggregation" and value in METHODS:
        method = METHODS[value]
        settings = " ".join(f"--{name} {setting}" for name, setting in method.overrides().items())
        return f" `{value}` names the method {method.display_name}; `run` takes it as `{settings}`."
    return closest_key_hint(value, map(str, choices))


# Fields the federation sets on each client's configuration, never a user: parsed, but hidden from --help.
INTERNAL_FIELDS = frozenset({"federation_round"})


class ArgumentParser(TrlParser):
    """TRL's `TrlParser` (a YAML `--config`, then `--key value` flags, never abbreviated) as a newcomer needs it:

    - `--help` lists the flags in one argument group per dataclass, as `HfArgumentParser` groups a dataclass that
      names one (`_argument_group_name`); a federated config's own fields form a group apart from the TRL config's.
    - A YAML key or flag that no dataclass has is refused in one line that names it and the closest valid one (or
      TRL's equivalent, `closest_key_hint`), before any dataclass is built; TRL raises "Unknown arguments" after a
      traceback, and argparse would print the whole usage (hundreds of flags) before its error line.
    """

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)

    @staticmethod
    def _groups(dtype) -> list[tuple[str, str, list[dataclasses.Field]]]:
        """(title, description, fields) of each argument group of `dtype`: one, or for a federated config the TRL
        config's fields, then the federation's."""
        from trl import GRPOConfig

        fields = [item for item in dataclasses.fields(dtype) if item.init]
        if not issubclass(dtype, FedGRPOConfig):
            return [(dtype.__name__, _first_line(dtype), fields)]
        trl_config = next(c for c in dtype.__mro__ if issubclass(c, GRPOConfig) and not issubclass(c, FedGRPOConfig))
        federation = {item.name for item in dataclasses.fields(FedGRPOConfig)} - {
            item.name for item in dataclasses.fields(GRPOConfig)
        }
        return [  # the federation's own fields first: they are what a user of this command comes to set
            (f"{dtype.__name__}: the federation", _first_line(dtype), [f for f in fields if f.name in federation]),
            (f"{trl_config.__name__} (TRL)", _first_line(trl_config), [f for f in fields if f.name not in federation]),
        ]

    def _add_dataclass_arguments(self, dtype):
        from typing import get_type_hints

        type_hints = get_type_hints(dtype)
        for title, description, fields in self._groups(dtype):
            group = self.add_argument_group(title, description)
            for item in fields:
                item.type = type_hints[item.name]
                self._parse_dataclass_field(group, item)
                if item.name in INTERNAL_FIELDS:  # parsed as any field, but not offered in --help
                    group._group_actions[-1].help = argparse.SUPPRESS

    def error(self, message: str):
        """One line, `prog: error: message`, exit status 2: argparse's usage line would list every flag."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args_and_config(self, args: Iterable[str] | None = None, **kwargs):
        """TRL's parsing, with every fault of the command line or the YAML said in one line (`error`): an unknown
        key or flag, a value outside a field's choices (argparse checks a flag's, never a YAML default's), a missing
        `--config` file, and what the configs' own checks refuse (`__post_init__`)."""
        args = list(sys.argv[1:] if args is None else args)
        flags = args
        choices = {action.dest: action.choices for action in self._actions if action.choices is not None}
        if "--config" in args[:-1]:
            at = args.index("--config")
            path, flags = args[at + 1], args[:at] + args[at + 2 :]
            values = read_yaml_config(path, self.error)
            fields = [action.dest for action in self._actions if action.option_strings] + ["env"]
            for key, value in values.items():
                if key not in fields:
                    self.error(f"unknown key `{key}` in {path}.{closest_key_hint(key, fields)}")
                if key in choices and value is not None and str(value) not in map(str, choices[key]):
                    self.error(f"`{key}: {value}` in {path} is not one of {list(choices[key])}."
                               f"{choice_hint(key, str(value), choices[key])}")
        options = [option for action in self._actions for option in action.option_strings]
        for index, token in enumerate(flags):
            flag, _, value = token.partition("=")
            if flag.startswith("--") and flag not in options:
                self.error(f"unknown flag `{flag}`.{closest_key_hint(flag, options)}")
            key = flag[2:]
            if key in choices and not value and index + 1 < len(flags):
                value = flags[index + 1]
            if key in choices and value and value not in map(str, choices[key]):
                hint = choice_hint(key, value, choices[key])  # argparse's own words, with the hint it lacks
                self.error(f"argument {flag}: invalid choice: {value!r} (choose from "
                           f"{', '.join(map(repr, choices[key]))}).{hint}")
        try:
            return super().parse_args_and_config(args, **kwargs)
        except (ValueError, TypeError) as fault:  # a config's own check (`__post_init__`), already one sentence
            self.error(str(fault).strip().replace("\n", " "))


def _first_line(cls) -> str:
    """The first line of a class's docstring, without the doc markup of cross references ([`~trl.GRPOConfig`])."""
    return re.sub(r"\[`~?([\w.]+)`\]", r"\1", (cls.__doc__ or "").strip().split("\n", 1)[0])


@dataclass
class BenchmarkArguments:
    """Which data the clients hold. The default is the embedded reasoning-gym benchmark."""

    dataset_name: str = field(
        default="reasoning_gym",
        metadata={
            "help": "'reasoning_gym' for the embedded procedural benchmark; 'open_r1' (Multimodal-Open-R1-8k-Verified, "
            "label `difficulty`) or 'geoqa' (GEOQA-8k, label `category`) for the paper's benchmarks, read from "
            "`benchmark_source`; or a `datasets.load_dataset` name or local path with `prompt`, `answer` and the "
            "partition column, and `train`/`test` splits."
        },
    )
    benchmark_source: str | None = field(
        default=None,
        metadata={
            "help": "For 'open_r1' and 'geoqa': the Hub dataset id or local copy (a `save_to_disk` folder or a parquet "
            "file) with the raw rows. None: the paper's Hub dataset."
        },
    )
    max_pixels: int | None = field(
        default=None,
        metadata={
            "help": "For 'open_r1' and 'geoqa': the largest image area in pixels; a larger figure is scaled down to "
            "it when the benchmark loads, keeping its aspect ratio (as `max_pixels` in R1-V and EasyR1). None: "
            "figures as stored."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "For a `datasets.load_dataset` name: its configuration name (`load_dataset`'s `name`), as in "
            "`trl grpo`."
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Training split of `dataset_name`."})
    dataset_test_split: str = field(default="test", metadata={"help": "Evaluation split of `dataset_name`."})
    benchmark_size: int = field(
        default=400, metadata={"help": "Items generated for the reasoning-gym benchmark, before the 80/20 split."}
    )
    benchmark_seed: int = field(
        default=0,
        metadata={"help": "Seed of the reasoning-gym generation, and of the 80/20 split of the paper's benchmarks."},
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many test items (None: the whole test split)."}
    )
    algorithm: str = field(
        default="grpo",
        metadata={
            "help": "Local RL algorithm, "
            + ", ".join(f"'{name}' ({config.__name__})" for name, config in CONFIG_CLASSES.items())
            + ": it picks the recipe defaults, which explicit keys still override.",
            "choices": list(CONFIG_CLASSES),
        },
    )
    trainer_class: str | None = field(
        default=None,
        metadata={
            "help": "The GRPOTrainer subclass every client trains with, as an import path: 'package.module:Class' or "
            "'package.module.Class' (e.g. 'trl.experimental.gmpo:GMPOTrainer', or your own trainer's module, "
            "importable from the working directory). None: TRL's GRPOTrainer."
        },
    )
    trainer_config_class: str | None = field(
        default=None,
        metadata={
            "help": "That trainer's own GRPOConfig subclass, as an import path (e.g. "
            "'trl.experimental.gmpo:GMPOConfig'): the run's config is then that class with the federation's fields "
            "(`federated_config`), with its defaults and fields, which `--key value` flags set like any other. It "
            "replaces `algorithm`'s recipe, so it needs algorithm 'grpo'. None: the config `algorithm` names."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A reward model's Hub id or local folder (`AutoModelForSequenceClassification`, loaded once per "
            "run), trained on before `reward_funcs`, as in `trl grpo`."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Reward functions: this package's {REWARD_FUNCTIONS} ('accuracy' is the paper's binary reward on "
            f"the `answer` column), TRL's {TRL_REWARD_FUNCTIONS} (as `trl grpo` configures them; they read a "
            "`solution` column), a function's dotted import path ('my_lib.rewards.custom_reward'), or reward models "
            "by Hub id or local folder. None: ['accuracy'], or only `reward_model_name_or_path` when it is set."
        },
    )
    eval_reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy"],
        metadata={
            "help": f"Reward functions that score the test split, among {REWARD_FUNCTIONS}, summed: the default "
            "reports accuracy whatever `reward_funcs` trains on."
        },
    )

    def __post_init__(self):
        from .data.paper import check_max_pixels

        check_max_pixels(self.max_pixels)
        builders = ("reasoning_gym", "open_r1", "geoqa")
        close = difflib.get_close_matches(self.dataset_name, builders, n=1, cutoff=0.75)
        if self.dataset_name not in builders and "/" not in self.dataset_name and close and not Path(
            self.dataset_name
        ).exists():
            raise ValueError(f"unknown `dataset_name` {self.dataset_name!r}. Did you mean `{close[0]}`?")


def check_model_path(model_name_or_path: str | None) -> None:
    """`usage_error` for a `model_name_or_path` written as a local path (absolute, `./`, `../`, `~`, or more than the
    one `/` of a Hub id `org/name`) that does not exist: before the data is built, in one line, not the Hub client's
    `HFValidationError` after it."""
    if model_name_or_path is None:
        return
    path = Path(model_name_or_path).expanduser()
    written_as_path = model_name_or_path.startswith(("/", "./", "../", "~")) or model_name_or_path.count("/") > 1
    if written_as_path and not path.exists():
        usage_error(f"`model_name_or_path` {model_name_or_path!r}: no such folder. Give a local model folder or a "
                    "Hub id (`org/name`), or leave it unset for the embedded SmolLM2-135M-Instruct.")


def load_benchmark(data_args: BenchmarkArguments):
    """The train and test splits named by `data_args`."""
    from datasets import load_dataset, load_from_disk

    from .data import (
        GEOQA_DATASET,
        OPEN_R1_DATASET,
        build_geoqa_benchmark,
        build_open_r1_benchmark,
        build_reasoning_benchmark,
    )

    paper_benchmarks = {
        "open_r1": (build_open_r1_benchmark, OPEN_R1_DATASET),
        "geoqa": (build_geoqa_benchmark, GEOQA_DATASET),
    }
    for name in ("benchmark_source", "max_pixels"):
        if getattr(data_args, name) is not None and data_args.dataset_name not in paper_benchmarks:
            raise ValueError(
                f"`{name}` is read only by the paper benchmarks {list(paper_benchmarks)}, not by "
                f"dataset_name={data_args.dataset_name!r}."
            )
    saved = (Path(data_args.dataset_name) / "dataset_dict.json").is_file()  # a `save_to_disk` folder
    generated = data_args.dataset_name in ("reasoning_gym", *paper_benchmarks)
    if data_args.dataset_config is not None and (saved or generated):
        raise ValueError(
            f"`dataset_config` names a configuration of a `datasets.load_dataset` dataset; "
            f"dataset_name={data_args.dataset_name!r} has none."
        )
    if data_args.dataset_name == "reasoning_gym":
        splits = build_reasoning_benchmark(size=data_args.benchmark_size, seed=data_args.benchmark_seed)
    elif data_args.dataset_name in paper_benchmarks:
        build, hub_id = paper_benchmarks[data_args.dataset_name]
        splits = build(
            data_args.benchmark_source or hub_id, seed=data_args.benchmark_seed, max_pixels=data_args.max_pixels
        )
    elif saved:
        splits = load_from_disk(data_args.dataset_name)
    else:
        splits = load_dataset(data_args.dataset_name, data_args.dataset_config)
    train, test = splits[data_args.dataset_train_split], splits[data_args.dataset_test_split]
    if data_args.max_eval_samples is not None:
        test = test.select(range(min(data_args.max_eval_samples, len(test))))
    return train, test


def hub_dataset_id(data_args: BenchmarkArguments) -> str | None:
    """The Hub id of the clients' data, for the model card; None for the generated benchmark or local data."""
    from .data import GEOQA_DATASET, OPEN_R1_DATASET

    sources = {"open_r1": OPEN_R1_DATASET, "geoqa": GEOQA_DATASET}
    name = data_args.dataset_name
    if name in sources:
        name = data_args.benchmark_source or sources[name]
    return None if name == "reasoning_gym" or Path(name).exists() else name


def trl_reward_function(name: str):
    """TRL's reward function `name` (`TRL_REWARD_FUNCTIONS`), configured as `trl grpo` configures it."""
    from trl import rewards

    if name == "get_soft_overlong_punishment":
        return rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return getattr(rewards, name)


def reward_functions(names: list[str], field_name: str = "reward_funcs") -> list:
    """The reward functions `names` gives, as `trl grpo` reads its `reward_funcs`: this package's `REWARD_FUNCTIONS`,
    TRL's (`TRL_REWARD_FUNCTIONS`), and any function by dotted import path (`my_lib.rewards.custom_reward`,
    importable from the working directory); an entry with a `/` or naming a folder is a reward model's Hub id or local
    folder, kept as such for `FederatedRunner` to load once (`client.load_reward_models`)."""
    from .rewards import answer_accuracy_reward, format_reward

    available = {"accuracy": answer_accuracy_reward, "format": format_reward}
    functions = []
    for name in names:
        if name in available:
            functions.append(available[name])
        elif name in TRL_REWARD_FUNCTIONS:
            functions.append(trl_reward_function(name))
        elif "/" in name or Path(name).is_dir():
            functions.append(name)
        elif "." in name:
            functions.append(import_object(name, field_name))
        else:
            raise ValueError(
                f"Unknown `{field_name}` {name!r}; choose among {list(REWARD_FUNCTIONS + TRL_REWARD_FUNCTIONS)}, a "
                "function's dotted import path (`my_lib.rewards.custom_reward`), or a reward model's Hub id "
                f"(`org/name`) or local folder.{closest_key_hint(name, REWARD_FUNCTIONS + TRL_REWARD_FUNCTIONS)}"
            )
    return functions


def training_rewards(data_args: BenchmarkArguments) -> list:
    """The training rewards, as `trl grpo` assembles them: `reward_model_name_or_path` first, then `reward_funcs`;
    `reward_funcs` left unset is the paper's `accuracy` alone, or nothing beside a reward model."""
    names = [data_args.reward_model_name_or_path] if data_args.reward_model_name_or_path else []
    if data_args.reward_funcs is not None:
        names += data_args.reward_funcs
    elif not names:
        names = ["accuracy"]
    return reward_functions(names)


# What TRL's GRPOTrainer passes every reward function besides the dataset's columns (`_calculate_rewards`).
TRAINER_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                            "environments")  # fmt: skip


def check_reward_columns(reward_funcs: list, dataset, field_name: str = "reward_funcs") -> None:
    """Refuse, naming the function and the column, a reward function whose required arguments are columns that
    `dataset` lacks (TRL passes every column to the reward functions by name, and a missing one fails only at the
    first training step)."""
    import inspect

    for function in reward_funcs:
        if not callable(function) or isinstance(function, torch.nn.Module):
            continue
        parameters = inspect.signature(function).parameters.values()
        required = [
            parameter.name for parameter in parameters
            if parameter.default is inspect.Parameter.empty
            and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and parameter.name not in TRAINER_REWARD_ARGUMENTS
        ]  # fmt: skip
        missing = [name for name in required if name not in dataset.column_names]
        if missing:
            name = getattr(function, "__name__", repr(function))
            advice = (
                " TRL's rewards score a `solution` column; `accuracy` is this package's binary reward on the "
                "`answer` column (`answer_accuracy_reward`; the embedded and paper benchmarks)."
                if getattr(function, "__module__", "").startswith("trl.")
                else ""
            )
            raise ValueError(
                f"`{field_name}`: {name} ({function.__module__}) reads the column(s) {missing}, which the data lacks "
                f"(columns: {dataset.column_names}).{advice}"
            )


def import_object(path: str, field_name: str, kind: str = "name"):
    """The object `path` names, 'package.module:name' or 'package.module.name', importable from the working directory
    (as `trl grpo` imports its dotted reward paths); any failure is a ValueError naming `field_name` and the path."""
    module_name, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"`{field_name}` must be 'package.module:{kind}' or 'package.module.{kind}', got {path!r}.")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"`{field_name}` {path!r}: cannot import module {module_name!r} ({error}).") from error
    if not hasattr(module, name):
        public = [attribute for attribute in dir(module) if not attribute.startswith("_")]
        raise ValueError(
            f"`{field_name}` {path!r}: module {module_name!r} has no attribute {name!r}."
            f"{closest_key_hint(name, public)}"
        )
    return getattr(module, name)


def import_class(path: str, base: type, field_name: str) -> type:
    """The class `path` names (`import_object`), which must subclass `base`; any failure is a ValueError naming
    `field_name` and the path."""
    cls = import_object(path, field_name, kind="Class")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"`{field_name}` {path!r} is {cls!r}, not a subclass of `{base.__module__}.{base.__name__}`.")
    return cls


def _setting(argv: list[str], name: str, default):
    """`--name value` from `argv`, else `name:` from the `--config` YAML, else `default`; read before parsing, for the
    settings that decide which config class parses the rest."""
    value = default
    if "--config" in argv[:-1]:
        value = read_yaml_config(argv[argv.index("--config") + 1], usage_error).get(name, value)
    if f"--{name}" in argv[:-1]:
        value = argv[argv.index(f"--{name}") + 1]
    return value


def config_class(argv: list[str]) -> type[FedGRPOConfig]:
    """The config dataclass named by `--algorithm` (or `algorithm:` in the `--config` YAML), or by
    `--trainer_config_class` made federated (`config.federated_config`); read before parsing because the recipe
    decides the defaults of the other fields."""
    algorithm = _setting(argv, "algorithm", "grpo")
    if algorithm not in CONFIG_CLASSES:
        raise ValueError(f"`algorithm` must be one of {list(CONFIG_CLASSES)}, got {algorithm!r}.")
    trainer_config = _setting(argv, "trainer_config_class", None)
    if trainer_config is None:
        return CONFIG_CLASSES[algorithm]
    if algorithm != "grpo":
        raise ValueError(
            f"`trainer_config_class` ({trainer_config!r}) brings its own recipe defaults, which would replace "
            f"`algorithm` {algorithm!r}'s: set the recipe's fields with flags, and leave `algorithm` at 'grpo'."
        )
    from trl import GRPOConfig

    return federated_config(import_class(trainer_config, GRPOConfig, "trainer_config_class"))


def trainer_class(data_args: BenchmarkArguments):
    """The federated trainer class `data_args.trainer_class` names (`trainer.federated`); `FedGRPOTrainer` by
    default."""
    from trl import GRPOTrainer

    from .trainer import federated

    if data_args.trainer_class is None:
        return federated(GRPOTrainer)
    return federated(import_class(data_args.trainer_class, GRPOTrainer, "trainer_class"))


def parse_run_args(argv: list[str]) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """The three argument groups of `trl-federated run` from `--config` and `--key value` flags.

    Flags are never abbreviated: `--num_round` is an unknown flag, not `--num_rounds`, refused in one line that names
    the closest flag, as is an unknown YAML key (`ArgumentParser`). A federation always trains a LoRA adapter, so
    `use_peft` is on and ModelConfig's LoRA fields default to `default_lora_config()`'s values: `--lora_r 4` alone
    changes the adapter.
    """
    from .adapters import default_lora_config

    try:
        dtype = config_class(argv)
    except ValueError as fault:
        usage_error(str(fault))
    parser = ArgumentParser((dtype, ModelConfig, BenchmarkArguments), prog="trl-federated run",
                            usage="%(prog)s [-h] [--config CONFIG.yaml] [--FIELD VALUE ...]",
                            description=RUN_DESCRIPTION)
    lora = default_lora_config()
    parser.set_defaults(
        use_peft=True, lora_r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
        lora_target_modules=[lora.target_modules], lora_task_type=lora.task_type,
    )  # fmt: skip
    return parser.parse_args_and_config(argv)


def changed_fields(model_args: ModelConfig, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` that differ from ModelConfig's defaults."""
    defaults = {item.name: item.default for item in dataclasses.fields(ModelConfig)}
    return [name for name in names if getattr(model_args, name) != defaults[name]]


def lora_config(model_args: ModelConfig):
    """The federation's LoRA configuration: TRL's `get_peft_config` over every `lora_*`, `use_rslora`, `use_dora`."""
    if not model_args.use_peft:
        raise ValueError(
            "`use_peft=false`: a federation always trains and exchanges a LoRA adapter; full fine-tuning is not "
            "supported. Drop `use_peft`, or set the adapter with the `lora_*` fields."
        )
    return get_peft_config(model_args)


def load_model(model_args: ModelConfig, args: FedGRPOConfig):
    """`(model, processing_class)` as the arguments ask, as TRL's `GRPOTrainer` would load a model named by id:
    ModelConfig's `dtype`, `attn_implementation`, `model_revision` and 4/8-bit loading (QLoRA, TRL's
    `get_quantization_config`), the config's `trust_remote_code` and `model_init_kwargs`. A field that cannot apply
    is refused by name, never ignored."""
    from .models import load_model_and_tokenizer

    bnb_fields = changed_fields(model_args, ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage"))
    if bnb_fields and not model_args.load_in_4bit:
        raise ValueError(f"{bnb_fields} are read only with `load_in_4bit`, which is off.")
    model_kwargs = dict(args.model_init_kwargs or {})
    named = {"dtype", "revision", "attn_implementation", "trust_remote_code", "quantization_config"} & set(model_kwargs)
    if named:
        raise ValueError(
            f"Set {sorted(named)} with their own flags (`dtype`, `model_revision`, `attn_implementation`, "
            "`trust_remote_code`, `load_in_4bit`/`load_in_8bit`), not in `model_init_kwargs`."
        )
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"`{flag}` (QLoRA) needs bitsandbytes, which is not installed: `pip install bitsandbytes`")
        # transformers places the quantized weights itself (TRL 1.16's scripts pass no device_map either)
        model_kwargs["quantization_config"] = quantization_config
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    return load_model_and_tokenizer(
        model_args.model_name_or_path,
        dtype=dtype,
        revision=model_args.model_revision,
        trust_remote_code=args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        **model_kwargs,
    )


def run(argv: list[str]) -> int:
    """Federate GRPO on the configured model and benchmark; write adapters, metrics, summary and plots."""
    from accelerate import PartialState

    from .checkpoint import prepare_output_dir
    from .data import partition_clients
    from .data.partition import split_description
    from .distributed import shut_down
    from .hub import HubPushError
    from .runner import FederatedRunner

    args, model_args, data_args = parse_run_args(argv)
    check_model_path(model_args.model_name_or_path)
    peft_config = lora_config(model_args)
    try:  # what the command line names, refused in one line before output_dir or any loading is touched
        federated_trainer = trainer_class(data_args)
        rewards = training_rewards(data_args)
        eval_rewards = reward_functions(data_args.eval_reward_funcs, "eval_reward_funcs")
    except ValueError as fault:
        usage_error(str(fault))
    start = time.perf_counter()
    train, test = load_benchmark(data_args)
    try:  # a reward reading a column the data lacks would fail only at the first training step; a partition that
        # cannot be drawn, before anything is written
        check_reward_columns(rewards, train)
        check_reward_columns(eval_rewards, test, "eval_reward_funcs")
        clients = partition_clients(train, args)
    except ValueError as fault:
        usage_error(str(fault))
    # A taken output_dir or a missing checkpoint fails here, before the model loads; after every check of the
    # command line, so that a refused run leaves a folder `overwrite_output_dir` would clear as it was.
    prepare_output_dir(args, PartialState().is_main_process)
    model, processing_class = load_model(model_args, args)
    header = (
        f"Model `{model_args.model_name_or_path or 'SmolLM2-135M-Instruct (embedded)'}`, "
        f"{args.num_clients} clients ({split_description(args, train)}), "
        f"{args.num_rounds} rounds × {args.local_steps} local steps (W={args.reward_window}), "
        f"{data_args.algorithm.upper() if data_args.trainer_class is None else federated_trainer.__name__} locally, "
        f"aggregation `{args.aggregation}` + server `{args.server_optimizer}` (lr {args.server_learning_rate}); "
        f"{len(train)} train / {len(test)} test items."
    )
    # The runner's server writes summary.md and the plots after every round, and result.json at the end.
    runner = FederatedRunner(
        model, rewards, args, clients, processing_class=processing_class, peft_config=peft_config,
        eval_dataset=test, eval_reward_funcs=eval_rewards, dataset_name=hub_dataset_id(data_args), report_header=header,
        trainer_class=federated_trainer,
    )
    push_error = None
    try:
        runner.run()
    except HubPushError as error:  # the run itself finished and is saved: it still gets its result.json
        push_error = error
    if runner.is_main_process:
        summary = (Path(args.output_dir) / "summary.md").read_text(encoding="utf-8")
        print(summary)
        print(f"Finished in {time.perf_counter() - start:.0f} s; outputs in {args.output_dir}")
    shut_down()
    if push_error is not None:
        raise push_error
    return 0


def compare(argv: list[str]) -> int:
    """Methods × seeds grid with resumable cells; see `trl_federated.compare`."""
    from .compare import main as compare_main

    return compare_main(argv)


COMMANDS = {
    "run": (run, "one federated run (FGRPO, FedAvg, FedProx, SCAFFOLD; GRPO, DAPO, GSPO or your trainer locally) "
            "from a YAML --config and --key value flags"),
    "compare": (compare, "a resumable grid of methods x seeds, each cell a `run`, and the paper's tables"),
}  # fmt: skip
RUN_DESCRIPTION = (
    "Federated GRPO-family RL fine-tuning of a LoRA adapter. Arguments parse like TRL's scripts: a YAML `--config`, "
    "then `--key value` flags, which override it. The groups below are the dataclasses they fill."
)


def version_line() -> str:
    """`trl-federated --version`: this package's version and the versions of what it runs on."""
    from importlib import metadata

    from . import __version__

    versions = []
    for package in ("trl", "transformers", "peft", "torch"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return f"trl-federated {__version__} ({', '.join(versions)})"


def command_parser() -> argparse.ArgumentParser:
    """`trl-federated`'s own parser: its commands, one line each (each command parses its own arguments)."""
    parser = argparse.ArgumentParser(
        prog="trl-federated",
        description="Federated GRPO-family RL fine-tuning (FGRPO, FedAvg, FedProx, SCAFFOLD) on Hugging Face TRL.",
        epilog="`trl-federated COMMAND --help` lists a command's flags.",
    )
    parser.add_argument("--version", action="store_true", help="print the versions of trl-federated, TRL, "
                        "transformers, PEFT and torch, and exit")
    commands = parser.add_subparsers(title="commands", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_text) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = command_parser()
        if argv and argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        if argv and argv[0] == "--version":
            print(version_line())
            return 0
        parser.print_usage(sys.stderr)
        if argv:
            print(f"trl-federated: error: unknown command `{argv[0]}`.{closest_key_hint(argv[0], COMMANDS)}",
                  file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # TRL 1.16's own defaults trigger transformers' rename notice for gradient checkpointing on every config.
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing` is deprecated", category=FutureWarning)
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
