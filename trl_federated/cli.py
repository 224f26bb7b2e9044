"""`trl-federated` command line: `trl-federated run --config examples/configs/quickstart.yaml [--key value ...]`.

It parses and dispatches, nothing else: the arguments parse in `arguments` (like TRL's own scripts, `TrlParser`), the
data loads in `data.loading`, the rewards resolve in `scoring.rewards`, the model loads in `runtime.models` and the
trainer class in `trainer`; `run` hands the parsed arguments to `federation.run_federation`, `compare` to
`reports.compare`, `new-app` its folder to `arguments.shipped.new_flower_app`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .names import closest_key_hint


def run(argv: list[str]) -> int:
    """Federate GRPO on the configured model and benchmark (`federation.run_federation`); write adapters, metrics,
    summary and plots. The `--config` YAML and the names of its keys and of the flags are checked before TRL and torch
    import (`arguments.flags`)."""
    from .arguments.flags import check_before_import, usage_error
    from .arguments.shipped import shipped_file, take_option, with_shipped_config

    argv = with_shipped_config(argv)
    accelerate_config, argv = take_option(argv, "--accelerate_config", usage_error)
    if accelerate_config is not None:
        return launch(shipped_file(accelerate_config, "accelerate"), argv)
    check_before_import(argv)
    from .arguments import parse_run_args
    from .federation import run_federation

    return run_federation(*parse_run_args(argv))


def launch(accelerate_config: str, argv: list[str]) -> int:
    """`trl-federated run --accelerate_config CONFIG ...`: the run on the processes an accelerate config file describes
    (a path, or a shipped one by name: `multi_gpu`, `deepspeed_zero2`, `cpu_two_processes`), through `accelerate
    launch --config_file CONFIG -m trl_federated.cli run ...`, as `trl grpo --accelerate_config` launches TRL's
    script. Each process parses and checks the arguments itself."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_command(launch_command_parser().parse_args(
        ["--config_file", accelerate_config, "-m", "trl_federated.cli", "run", *argv]
    ))
    return 0


def compare(argv: list[str]) -> int:
    """Methods × seeds grid with resumable cells; see `trl_federated.reports.compare`."""
    from .arguments.shipped import with_shipped_config
    from .reports.compare import main as compare_main

    return compare_main(with_shipped_config(argv))


def new_app(argv: list[str]) -> int:
    """A new Flower app folder, as `flwr new` makes one (`arguments.shipped.new_flower_app`): its pyproject.toml
    names the packaged ServerApp and ClientApp and carries the quickstart's federation as its run config, ready for
    `flwr run`."""
    from pathlib import Path

    from .arguments.flags import usage_error
    from .arguments.shipped import new_flower_app

    parser = argparse.ArgumentParser(
        prog="trl-federated new-app",
        description="Write a ready-to-run Flower app into a new or empty folder, as `flwr new` does: a pyproject.toml "
        "whose components are trl-federated's ServerApp and ClientApp (trl_federated.flower.fgrpo_app) and whose run "
        "config is the quickstart's federation on the embedded SmolLM2-135M-Instruct (the example app's, "
        "examples/flower/pyproject.toml). A folder that holds anything is refused and left as it is.",
    )
    parser.add_argument("folder", type=Path, help="the app folder to make: new, or empty")
    folder = parser.parse_args(argv).folder
    try:
        pyproject = new_flower_app(folder)
    except OSError as error:  # one line, as every refusal of the command line
        usage_error(str(error), parser.prog)
    print(f"Wrote {pyproject}. Try it on Flower's Simulation Engine: flwr run {folder} --stream")
    return 0


COMMANDS = {
    "run": (run, "one federated run (FGRPO, FedAvg, FedProx, SCAFFOLD; GRPO, DAPO, GSPO or your trainer locally) "
            "from a YAML --config and --key value flags"),
    "compare": (compare, "a resumable grid of methods x seeds, each cell a `run`, and the paper's tables"),
    "new-app": (new_app, "a ready-to-run Flower app in a new folder, as `flwr new` makes one: trl-federated's "
                "ServerApp and ClientApp, the quickstart's federation as its run config"),
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
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
