"""`trl-federated` command line: `trl-federated run --config examples/configs/quickstart.yaml [--key value ...]`.

It parses and dispatches, nothing else: the arguments parse in `arguments` (like TRL's own scripts, `TrlParser`), the
data loads in `data.loading`, the rewards resolve in `rewards`, the model loads in `models` and the trainer class in
`trainer`; `run` puts them together for a `FederatedRunner`, `compare` hands over to `compare`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

# What `trl-federated run` parses, loads and trains with, each in its concept's module; named here too, where the
# README's examples import them from.
from .arguments import (  # noqa: F401
    ArgumentParser,
    BenchmarkArguments,
    check_model_path,
    choice_hint,
    config_class,
    parse_run_args,
    read_yaml_config,
    usage_error,
)
from .data.loading import hub_dataset_id, load_benchmark  # noqa: F401
from .names import closest_key_hint, import_class, import_object  # noqa: F401
from .runtime.models import changed_fields, load_model, lora_config  # noqa: F401
from .scoring.rewards import (  # noqa: F401
    REWARD_FUNCTIONS,
    TRL_REWARD_FUNCTIONS,
    check_reward_columns,
    reward_functions,
    training_rewards,
)
from .trainer import trainer_class  # noqa: F401

logger = logging.getLogger("trl_federated")


def run(argv: list[str]) -> int:
    """Federate GRPO on the configured model and benchmark; write adapters, metrics, summary and plots."""
    from accelerate import PartialState

    from .core.checkpoint import prepare_output_dir
    from .data import partition_clients
    from .data.partition import split_description
    from .reports.hub import HubPushError
    from .runner import FederatedRunner
    from .runtime.distributed import shut_down

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
    from .reports.compare import main as compare_main

    return compare_main(argv)


COMMANDS = {
    "run": (run, "one federated run (FGRPO, FedAvg, FedProx, SCAFFOLD; GRPO, DAPO, GSPO or your trainer locally) "
            "from a YAML --config and --key value flags"),
    "compare": (compare, "a resumable grid of methods x seeds, each cell a `run`, and the paper's tables"),
}  # fmt: skip


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
