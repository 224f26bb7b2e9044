"""The parsing of `trl-federated run`: `ArgumentParser`, `BenchmarkArguments`, `config_class`, `run_parser` and
`parse_run_args`.

Arguments parse like TRL's own scripts (`TrlParser`): a YAML file, overridden by `--key value` flags, filling a
`FedGRPOConfig` (training and federation), a `ModelConfig` (model and LoRA) and `BenchmarkArguments` (data).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, TrlParser

from .. import choices
from ..config import CONFIG_CLASSES, FedGRPOConfig, federated_config
from ..names import import_object
from ..scoring.rewards import REWARD_FUNCTIONS, TRL_REWARD_FUNCTIONS
from .flags import (
    check_choices,
    check_names,
    installed_versions,
    setting,
    split_config,
    usage_error,
)

# Fields the federation sets on each client's configuration, never a user: parsed, but hidden from --help.
INTERNAL_FIELDS = frozenset({"federation_round"})


class ArgumentParser(TrlParser):
    """TRL's `TrlParser` (a YAML `--config`, then `--key value` flags, never abbreviated) as a newcomer needs it:

    - `--help` lists `--config` among the options, then the flags in one argument group per dataclass, titled by
      the dataclass and what its flags set (`GROUP_SUBJECTS`); a federated config's own fields form a group apart
      from the TRL config's. Shorter groups come first and TRL's after this package's, so that the data, the
      algorithm, the rewards and the federation come before TRL's hundreds of training flags.
    - A YAML key or flag that no dataclass has is refused in one line that names it and the closest valid one (or
      TRL's equivalent, `closest_key_hint`), before any dataclass is built; TRL raises "Unknown arguments" after a
      traceback, and argparse would print the whole usage (hundreds of flags) before its error line.
    """

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)
        # TrlParser takes `--config` out of the arguments before parsing: declared for --help, it never reaches the
        # dataclasses (no default, so no `config` in the namespace).
        self.add_argument("--config", metavar="CONFIG.yaml", default=argparse.SUPPRESS,
                          help="a YAML file of `field: value` lines (the fields below); flags override it")
        self._action_groups.sort(key=lambda group: ("(TRL)" in (group.title or ""), len(group._group_actions)))

    @staticmethod
    def _groups(dtype) -> list[tuple[str, str, list[dataclasses.Field]]]:
        """(title, description, fields) of each argument group of `dtype`: one, or for a federated config the TRL
        config's fields, then the federation's."""
        from trl import GRPOConfig

        fields = [item for item in dataclasses.fields(dtype) if item.init]
        if not issubclass(dtype, FedGRPOConfig):
            title = f"{dtype.__name__}{' (TRL)' if dtype.__module__.startswith('trl.') else ''}"
            subject = GROUP_SUBJECTS.get(dtype.__name__)
            return [(f"{title}: {subject}" if subject else title, _first_line(dtype), fields)]
        trl_config = next(c for c in dtype.__mro__ if issubclass(c, GRPOConfig) and not issubclass(c, FedGRPOConfig))
        federation = {item.name for item in dataclasses.fields(FedGRPOConfig)} - {
            item.name for item in dataclasses.fields(GRPOConfig)
        }
        return [
            (f"{dtype.__name__}: the federation", _first_line(dtype), [f for f in fields if f.name in federation]),
            (f"{trl_config.__name__} (TRL): local training", _first_line(trl_config),
             [f for f in fields if f.name not in federation]),
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
        values, path, flags = split_config(args, self.error)
        fields = [action.dest for action in self._actions if action.option_strings and action.dest != "config"]
        options = [option for action in self._actions for option in action.option_strings if option != "--config"]
        check_names(values, path, flags, fields, options, self.error)
        choices = {action.dest: action.choices for action in self._actions if action.choices is not None}
        check_choices(values, path, flags, choices, self.error)
        try:
            return super().parse_args_and_config(args, **kwargs)
        except (ValueError, TypeError) as fault:  # a config's own check (`__post_init__`), already one sentence
            self.error(str(fault).strip().replace("\n", " "))


# What the flags of a dataclass that is not a config set, in its --help group's title.
GROUP_SUBJECTS = {
    "ModelConfig": "the model and its LoRA adapter",
    "BenchmarkArguments": "the data, the local algorithm, the rewards and the trainer class",
}


def _first_line(cls) -> str:
    """The first line of a class's docstring, without the doc markup of cross references ([`~trl.GRPOConfig`])."""
    return re.sub(r"\[`~?([\w.]+)`\]", r"\1", (cls.__doc__ or "").strip().split("\n", 1)[0])


@dataclass
class BenchmarkArguments:
    """The clients' data (by default the embedded reasoning-gym benchmark), the local algorithm, rewards and trainer."""

    dataset_name: str = field(
        default="reasoning_gym_balanced",
        metadata={
            "help": "'reasoning_gym_balanced' for the embedded procedural benchmark (no gold answer over a tenth of a "
            "task's items); 'reasoning_gym' for its first version, where answering \"1\" scores three in four of "
            "letter_counting (kept for the committed results measured on it); 'open_r1' "
            "(Multimodal-Open-R1-8k-Verified, label `difficulty`) or 'geoqa' (GEOQA-8k, label `category`) for the "
            "paper's benchmarks, read from `benchmark_source`; or a `datasets.load_dataset` name or local path with "
            "`prompt`, `answer` and the partition column, and `train`/`test` splits."
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
        default=400, metadata={"help": "Items generated for the reasoning-gym benchmarks, before the 80/20 split."}
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
            "help": "The GRPOTrainer or RLOOTrainer subclass every client trains with, as an import path: "
            "'package.module:Class' or 'package.module.Class' (e.g. 'trl.experimental.gmpo:GMPOTrainer', "
            "'trl:RLOOTrainer', whose config is then RLOOConfig's with the federation's fields, or your own "
            "trainer's module, importable from the working directory). None: TRL's GRPOTrainer."
        },
    )
    trainer_config_class: str | None = field(
        default=None,
        metadata={
            "help": "That trainer's own GRPOConfig or RLOOConfig subclass, as an import path (e.g. "
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
        from ..data.loading import GENERATED_BENCHMARKS
        from ..data.paper import check_max_pixels

        check_max_pixels(self.max_pixels)
        builders = (*GENERATED_BENCHMARKS, "open_r1", "geoqa")
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


def config_class(argv: list[str]) -> type[FedGRPOConfig]:
    """The config dataclass named by `--algorithm` (or `algorithm:` in the `--config` YAML), or by
    `--trainer_config_class` made federated (`config.federated_config`); read before parsing because the recipe
    decides the defaults of the other fields."""
    algorithm = setting(argv, "algorithm", "grpo")
    if algorithm not in CONFIG_CLASSES:
        raise ValueError(f"`algorithm` must be one of {list(CONFIG_CLASSES)}, got {algorithm!r}.")
    trainer_config = setting(argv, "trainer_config_class", None)
    source = f"`trainer_config_class` ({trainer_config!r})"
    if trainer_config is None:
        trainer = setting(argv, "trainer_class", None)
        family_config = None if trainer is None else _family_config(trainer)
        if family_config is None:
            return CONFIG_CLASSES[algorithm]
        trainer_config = f"{family_config.__module__}:{family_config.__name__}"  # RLOO's: the recipes are GRPO's
        source = f"`trainer_class` ({trainer!r}, configured by {family_config.__name__})"
    if algorithm != "grpo":
        raise ValueError(
            f"{source} brings its own recipe defaults, which would replace "
            f"`algorithm` {algorithm!r}'s: set the recipe's fields with flags, and leave `algorithm` at 'grpo'."
        )
    from ..config import federable_configs

    config = import_object(trainer_config, "trainer_config_class", kind="Class")
    try:
        return federated_config(config)
    except TypeError:
        raise ValueError(f"`trainer_config_class` {trainer_config!r} is {config!r}, not a subclass of "
                         f"{' or '.join(f'`{c.__module__}.{c.__name__}`' for c in federable_configs())}.") from None


def _family_config(trainer: str) -> type | None:
    """The TRL config of the family of the trainer class `trainer` names (`local_trainer.trainer_config_class`), when
    it is not GRPO's (whose configs `algorithm` names), else None; a class that cannot federate is a ValueError."""
    from trl import GRPOConfig

    from ..local.local_trainer import named_trainer_class, trainer_config_class

    config = trainer_config_class(named_trainer_class(trainer))
    return None if config is GRPOConfig else config


def parse_run_args(argv: list[str]) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """The three argument groups of `trl-federated run` from `--config` and `--key value` flags.

    Flags are never abbreviated: `--num_round` is an unknown flag, not `--num_rounds`, refused in one line that names
    the closest flag, as is an unknown YAML key (`ArgumentParser`). A federation always trains a LoRA adapter, so
    `use_peft` is on and ModelConfig's LoRA fields default to `default_lora_config()`'s values: `--lora_r 4` alone
    changes the adapter.
    """
    try:
        dtype = config_class(argv)
    except ValueError as fault:
        usage_error(str(fault))
    return run_parser(dtype).parse_args_and_config(argv)


def run_parser(dtype: type[FedGRPOConfig]) -> ArgumentParser:
    """The parser of `trl-federated run` for the config class `dtype`, with `ModelConfig`'s LoRA defaults set to
    `default_lora_config()`'s and `use_peft` on."""
    from ..adapters import default_lora_config

    parser = ArgumentParser((dtype, ModelConfig, BenchmarkArguments), prog="trl-federated run",
                            usage="%(prog)s [-h] [--config CONFIG.yaml] [--FIELD VALUE ...]",
                            description=RUN_DESCRIPTION)
    lora = default_lora_config()
    parser.set_defaults(
        use_peft=True, lora_r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
        lora_target_modules=[lora.target_modules], lora_task_type=lora.task_type,
    )  # fmt: skip
    return parser


RUN_DESCRIPTION = (
    "Federated GRPO-family RL fine-tuning of a LoRA adapter. Arguments parse like TRL's scripts: a YAML `--config`, "
    "then `--key value` flags, which override it. The groups below are the dataclasses they fill."
)


def known_flags_source() -> str:
    """The source of `known_flags` for the installed TRL and transformers: every algorithm's run parser's fields and
    option strings (the recipes change defaults, not fields)."""
    fields, options = set(), set()
    for config in CONFIG_CLASSES.values():
        actions = [action for action in run_parser(config)._actions if action.option_strings]
        fields.update(action.dest for action in actions if action.dest != "config")
        options.update(option for action in actions for option in action.option_strings)

    def names(values):  # whitespace-separated, wrapped: a few lines of data rather than a line per name
        return textwrap.fill(" ".join(sorted(values)), 116, break_on_hyphens=False, break_long_words=False)

    return (
        '"""The fields and option strings of `trl-federated run`\'s parser, for `flags.check_before_import`.\n'
        'Written by `python -m trl_federated.arguments.parsing`; tests/test_cli.py checks it against the parser."""\n\n'
        f"VERSIONS = {installed_versions()!r}  # TRL's and transformers'\n"
        f'FIELDS = tuple("""\n{names(fields)}\n""".split())\n'
        f'OPTIONS = tuple("""\n{names(options)}\n""".split())\n'
    )


# The actions a run parser holds, by the name `flags.recorded_parser` adds each with.
ACTION_KINDS = {
    argparse._StoreAction: "store", argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false", argparse._StoreConstAction: "store_const", argparse._HelpAction: "help",
}  # fmt: skip


def _type_name(action: argparse.Action) -> str | None:
    """The name `flags.recorded_type` rebuilds the type of `action` from: a builtin, TRL's `string_to_bool`
    ("bool"), TRL's `_accept_none` around one of those ("int or none": a `T | None` field), TRL's
    `make_choice_type_function` of the action's choices ("choice": an enum or `Literal` field), None (no conversion),
    or "other" (a type the record leaves to the parser)."""
    from trl.scripts import _hf_argparser

    convert = action.type
    names = {int: "int", float: "float", str: "str", _hf_argparser.string_to_bool: "bool"}
    if convert is None or convert in names:
        return names.get(convert)
    made_by = getattr(convert, "__qualname__", "").partition(".<locals>.")[0]
    code, cells = getattr(convert, "__code__", None), getattr(convert, "__closure__", None) or ()
    closure = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells))) if code else {}
    if made_by == _hf_argparser._accept_none.__name__ and closure.get("inner") in names:
        return f"{names[closure['inner']]} or none"
    if made_by == _hf_argparser.make_choice_type_function.__name__ and action.choices is not None and (
        closure.get("str_to_choice") == {str(choice): choice for choice in action.choices}
    ):
        return "choice"
    return "other"


def _action_record(action: argparse.Action, formatter: argparse.HelpFormatter) -> list:
    """What `flags.recorded_parser` rebuilds `action` from: kind, option strings, dest, nargs, const, type (a name of
    `flags.recorded_type`), choices and, for choices that are a registry, its name in `choices`, required, the metavar
    `--help` shows and the help text as `formatter` expands it (None: no help line)."""
    help_text = action.help
    if help_text and help_text.strip() and help_text != argparse.SUPPRESS:
        help_text = formatter._expand_help(action)
    metavar = None if action.nargs == 0 else formatter._metavar_formatter(action, action.dest.upper())(1)[0]
    if type(action) not in ACTION_KINDS:
        raise ValueError(f"`{action.dest}` is a {type(action).__name__}, which `flags.recorded_parser` cannot add")
    registry = None
    if isinstance(action.choices, choices.Registry):  # its name in `choices`, read live by `recorded_parser`
        registry = next(name for name, value in vars(choices).items() if value is action.choices)
    record = [ACTION_KINDS[type(action)], action.option_strings, action.dest, action.nargs, action.const,
              _type_name(action), None if action.choices is None else list(action.choices), registry,
              action.required, metavar, help_text]  # fmt: skip
    if json.loads(json.dumps(record)) != record:
        raise ValueError(f"`{action.dest}`'s action does not keep in JSON: {record}")
    return record


def known_parsers_source() -> str:
    """The text of `known_parsers.json` for the installed TRL and transformers: every algorithm's run parser, group by
    group and action by action (`_action_record`), for `flags.recorded_parser`. An action shared by several algorithms
    is written once, one action a line."""
    records, parsers, texts = {}, {}, set()
    for algorithm, config in CONFIG_CLASSES.items():
        parser = run_parser(config)
        formatter = parser._get_formatter()
        builtin = {id(parser._positionals): "positionals", id(parser._optionals): "optionals"}
        groups = [[group.title, group.description, builtin.get(id(group))] for group in parser._action_groups]
        if set(builtin.values()) - {row[2] for row in groups}:
            raise ValueError("the run parser lost its positional or optional arguments group")
        group_of = {id(action): index for index, group in enumerate(parser._action_groups)
                    for action in group._group_actions}  # fmt: skip
        actions = []
        for action in parser._actions:
            record = json.dumps(_action_record(action, formatter), ensure_ascii=False)
            actions.append([records.setdefault(record, len(records)), group_of[id(action)]])
        parsers[algorithm] = {"groups": groups, "actions": actions}
        texts.add((parser.prog, parser.usage, parser.description, parser.epilog))
    ((prog, usage, description, epilog),) = texts  # one for every algorithm
    head = {"about": "trl-federated run's parser of each algorithm, for `flags.recorded_parser`. Written by `python -m "
                     "trl_federated.arguments.parsing` with known_flags.py, for its VERSIONS; tests/test_cli.py checks "
                     "it against the parser.",
            "prog": prog, "usage": usage, "description": description, "epilog": epilog}  # fmt: skip
    lines = [f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}," for key, value in head.items()]
    lines += ['"actions": [', ",\n".join(records), "],", '"parsers": {']
    lines += [",\n".join(f"{json.dumps(name)}: {json.dumps(parser, ensure_ascii=False)}"
                          for name, parser in parsers.items()), "}"]  # fmt: skip
    return "{\n" + "\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    Path(__file__).with_name("known_flags.py").write_text(known_flags_source(), encoding="utf-8")
    Path(__file__).with_name("known_parsers.json").write_text(known_parsers_source(), encoding="utf-8")
