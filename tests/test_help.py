"""Every entry point answers `--help`: exit status 0, its flags on stdout, grouped by argument group as TRL's
`HfArgumentParser` groups a dataclass, and nothing run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The groups of `trl-federated run` and of examples/scripts/fgrpo.py, in order, and a flag each group must hold.
# The federation's own flags come first: they are what a user of these commands comes to set.
RUN_GROUPS = [("FedGRPOConfig: the federation:", "--num_rounds"), ("GRPOConfig (TRL):", "--learning_rate"),
              ("ModelConfig:", "--lora_r"), ("BenchmarkArguments:", "--reward_funcs")]  # fmt: skip


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
    groups = [("FedDAPOConfig: the federation:", "--aggregation"), ("GRPOConfig (TRL):", "--loss_type")]
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


def test_run_help_opens_on_the_federation_and_hides_what_only_the_federation_sets():
    lines = help_text("-m", "trl_federated.cli", "run").splitlines()
    assert lines[0] == "usage: trl-federated run [-h] [--config CONFIG.yaml] [--FIELD VALUE ...]"
    assert lines.index("FedGRPOConfig: the federation:") < 15  # on the first screen, not after all of GRPOConfig
    assert not any("--federation_round" in line for line in lines)  # set on each client's config by the runner


def test_version_names_the_package_and_what_it_runs_on():
    import trl

    result = subprocess.run([sys.executable, "-m", "trl_federated.cli", "--version"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("trl-federated 0.1.0 (trl ")
    assert f"trl {trl.__version__}" in result.stdout
