"""Every entry point answers `--help`: exit status 0, its flags on stdout, grouped by argument group as TRL's
`HfArgumentParser` groups a dataclass, and nothing run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The groups of `trl-federated run` and of examples/scripts/fgrpo.py, in order, and a flag each group must hold.
# What a user of these commands comes to set comes first: the options (`--config`), the data, algorithm and rewards,
# the federation; TRL's hundreds of training flags last.
RUN_GROUPS = [("options:", "--config"),
              ("BenchmarkArguments: the data, the local algorithm, the rewards and the trainer class:", "--algorithm"),
              ("FedGRPOConfig: the federation:", "--num_rounds"),
              ("ModelConfig (TRL): the model and its LoRA adapter:", "--lora_r"),
              ("GRPOConfig (TRL): local training:", "--learning_rate")]  # fmt: skip


def help_text(*command: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # A timeout, not a hang: a script that ignored --help would start training
    result = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: "), result.stdout[:500]
    return result.stdout


def assert_groups(text: str, groups: list[tuple[str, str]]) -> None:
    """Each group title is a line of `text`, in this order, and holds its flag (before the next group's title)."""
    lines = text.splitlines()
    starts = [lines.index(title) for title, _ in groups]
    assert starts == sorted(starts)
    for (title, flag), start, end in zip(groups, starts, [*starts[1:], len(lines)], strict=True):
        assert any(line.lstrip().startswith(flag + " ") for line in lines[start:end]), (title, flag)


def test_trl_federated_help_lists_its_commands_one_line_each():
    text = help_text("-m", "trl_federated.cli")
    lines = text.splitlines()
    for command in ("run", "compare"):
        assert any(line.split()[:1] == [command] and len(line.split()) > 1 for line in lines), command


def test_run_help_groups_its_flags_by_dataclass():
    assert_groups(help_text("-m", "trl_federated.cli", "run"), RUN_GROUPS)


def test_run_help_follows_the_algorithm():
    groups = [("FedDAPOConfig: the federation:", "--aggregation"), ("GRPOConfig (TRL): local training:", "--loss_type")]
    assert_groups(help_text("-m", "trl_federated.cli", "run", "--algorithm", "dapo"), groups)


def test_compare_help_groups_the_grid_and_points_to_run():
    text = help_text("-m", "trl_federated.cli", "compare")
    assert_groups(text, [("the grid:", "--methods")])
    assert "trl-federated run --help" in " ".join(text.split()).replace("trl- federated", "trl-federated")


def test_fgrpo_script_help_groups_its_flags_as_trl_grpo():
    assert_groups(help_text("examples/scripts/fgrpo.py"), RUN_GROUPS)


@pytest.mark.parametrize("script, argument", [
    ("examples/scripts/federate_custom_trainer.py", "output_dir"),
    ("examples/scripts/plot_tensorboard.py", "logdir"),
])  # fmt: skip
def test_example_script_help_describes_its_arguments(script, argument):
    text = help_text(script)
    assert_groups(text, [("positional arguments:", argument), ("options:", "-h, --help")])


def test_run_config_module_help():
    assert_groups(help_text("-m", "trl_federated.flower.run_config"), [("options:", "-h, --help")])


def test_run_help_opens_on_what_a_run_chooses_and_hides_what_only_the_federation_sets():
    lines = help_text("-m", "trl_federated.cli", "run").splitlines()
    assert lines[0] == "usage: trl-federated run [-h] [--config CONFIG.yaml] [--FIELD VALUE ...]"
    # the algorithm, rewards, trainer and the federation within the first pages, not after all of GRPOConfig's flags
    first = [line.split()[0] for line in lines[:120] if line.startswith("  --")]
    assert {"--algorithm", "--reward_funcs", "--trainer_class", "--num_rounds"} <= set(first)
    assert not any("--federation_round" in line for line in lines)  # set on each client's config by the runner


def test_version_names_the_package_and_what_it_runs_on():
    import trl

    result = subprocess.run([sys.executable, "-m", "trl_federated.cli", "--version"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("trl-federated 0.1.0 (trl ")
    assert f"trl {trl.__version__}" in result.stdout


def test_version_help_a_misspelled_key_and_a_bad_value_import_neither_torch_nor_trl(tmp_path):
    # Each of those imports seconds before a one-line answer; benchmarks/cli_startup.py times the commands.
    config = tmp_path / "run.yaml"
    config.write_text("lerning_rate: 1.0e-5\n", encoding="utf-8")
    probe = (
        "import contextlib, io, sys\n"
        "from trl_federated.cli import main\n"
        "for argv in (['--version'], ['--help'], ['compare', '--help'], ['run', '--help'],\n"
        "             ['run', '--config', sys.argv[1]], ['run', '--num_round', '2'], ['run', '--num_rounds', 'abc'],\n"
        "             ['run', '--aggregation', 'fgrpo']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print(sorted({'torch', 'transformers', 'trl', 'peft'} & set(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(config)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.stdout == "[]\n", result.stdout + result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        f"trl-federated run: error: unknown key `lerning_rate` in {config}. Did you mean `learning_rate`?",
        "trl-federated run: error: unknown flag `--num_round`. Did you mean `--num_rounds`?",
        "trl-federated run: error: argument --num_rounds/--num-rounds: invalid int value: 'abc'",
        "trl-federated run: error: argument --aggregation: invalid choice: 'fgrpo' (choose from 'rpg', 'fedavg', "
        "'fedprox', 'scaffold'). `fgrpo` names the method FGRPO; `run` takes it as `--aggregation rpg "
        "--server_optimizer sgd`.",
    ]


def test_run_help_printed_before_trl_imports_is_the_parsers(monkeypatch, registries_as_recorded):
    # `run --help` prints the parser as `known_parsers.json` records it (`flags.recorded_parser`), for the algorithm
    # the flags name; the text is the parser's (tests/test_cli.py checks the record at other widths)
    from trl_federated.arguments import run_parser
    from trl_federated.config import CONFIG_CLASSES

    monkeypatch.setenv("COLUMNS", "100")
    probe = (
        "import contextlib, io, json, sys\n"
        "from trl_federated.cli import main\n"
        "texts = []\n"
        "for argv in (['run', '--help'], ['run', '--algorithm', 'dapo', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as text:\n"
        "        main(argv)\n"
        "    texts.append(text.getvalue())\n"
        "print(json.dumps([texts, sorted({'torch', 'transformers', 'trl', 'peft'} & set(sys.modules))]))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    texts, imported = json.loads(result.stdout)
    assert imported == [], imported
    assert texts == [run_parser(CONFIG_CLASSES[name]).format_help() for name in ("grpo", "dapo")]
