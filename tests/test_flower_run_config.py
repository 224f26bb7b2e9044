"""A Flower run config as the arguments of `trl-federated run`: the example app's values are the quickstart's, every
field's key, the YAML base, refusals that name the key, `num_clients` against the federation's size, and `flwr run`
with the run's exit status and undeclared keys named (`flower.flwr_run`)."""

import dataclasses
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from trl_federated.arguments import parse_run_args  # noqa: E402
from trl_federated.cli import main as cli_main  # noqa: E402
from trl_federated.flower import flwr_run  # noqa: E402
from trl_federated.flower.fgrpo_app import APP_KEYS, build_strategy  # noqa: E402
from trl_federated.flower.run_config import FederationSizeError, federation_arguments  # noqa: E402
from trl_federated.runtime.models import DEFAULT_MODEL  # noqa: E402
from trl_federated.scoring.rewards import training_rewards  # noqa: E402

APP_DIR = Path(__file__).parents[1] / "examples" / "flower"


def example_run_config(**overrides):
    """The example app's [tool.flwr.app.config], fused with overrides as Flower fuses `--run-config`."""
    config = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(overrides) <= set(config)  # Flower refuses any other key before the app starts
    return {**config, **overrides}


def parse(run_config, federation_size=None):
    """The arguments of `trl-federated run` that the example app reads from `run_config`."""
    return federation_arguments(run_config, APP_DIR, app_keys=APP_KEYS, federation_size=federation_size)


# Where the example app differs from examples/configs/quickstart.yaml on purpose (each commented in its pyproject.toml):
# its own output folder, which a second run does not overwrite; num_clients, which follows the simulated SuperNodes.
DELIBERATE_DIFFERENCES = {"output_dir", "overwrite_output_dir", "num_clients"}
# The quickstart takes a GPU where there is one; the app keeps the CPU, where Flower's Simulation Engine keeps its
# clients unless given GPUs (pyproject.toml says why): equal on a CPU-only machine.
DEVICE_FIELDS = {"use_cpu", "bf16"}


def test_the_example_app_runs_the_quickstart_but_for_its_deliberate_differences():
    """`flwr run examples/flower` trains what `trl-federated run --config examples/configs/quickstart.yaml` trains:
    pyproject.toml carries the real values, none stale (a server learning rate, an optimizer that the quickstart
    derives per method), and every difference is one named here."""
    app = parse(example_run_config())
    quickstart = parse_run_args(["--config", str(APP_DIR.parents[1] / "examples" / "configs" / "quickstart.yaml")])
    assert training_rewards(app[2]) == training_rewards(quickstart[2])  # "accuracy" written out, the default
    # The embedded model by its name, which the quickstart leaves unset (`None` means the same).
    assert (app[1].model_name_or_path, quickstart[1].model_name_or_path) == (DEFAULT_MODEL, None)
    differing = {
        item.name
        for app_group, quickstart_group in zip(app, quickstart, strict=True)
        for item in dataclasses.fields(app_group)
        if item.name not in ("reward_funcs", "model_name_or_path")
        and getattr(app_group, item.name) != getattr(quickstart_group, item.name)
    }
    assert differing - DEVICE_FIELDS == DELIBERATE_DIFFERENCES
    args, model_args, data_args = app
    assert (args.num_rounds, args.local_steps, args.learning_rate, args.server_optimizer) == (3, 2, 2e-4, "sgd")
    assert args.server_learning_rate == quickstart[0].server_learning_rate  # derived, not set
    assert (model_args.lora_r, model_args.lora_dropout, data_args.benchmark_size) == (16, 0.0, 400)
    assert args.output_dir == "outputs/flower-fgrpo" and not args.overwrite_output_dir


def test_the_example_declares_real_values_and_leaves_unset_only_what_is_chosen_at_launch():
    config = example_run_config()
    unset = {key for key, value in config.items() if value == ""}
    assert unset == {"clients-file", "num-clients"}  # no registry; the federation's size
    assert {"num-server-rounds", "local-steps", "learning-rate", "lora-r", "aggregation", "num-clients",
            "model-name-or-path", "reward-funcs", "seed", "fraction-train", "fraction-evaluate"} <= set(config)


def test_run_config_keys_override_the_apps_values_field_by_field():
    args, model_args, data_args = parse(example_run_config(**{
        "num-server-rounds": 5, "local-steps": 4, "learning-rate": 1e-3, "aggregation": "fedavg", "lora-r": 4,
        "lora-target-modules": "q_proj,v_proj", "reward-funcs": "accuracy,format", "dirichlet-alpha": "inf",
    }))
    assert (args.num_rounds, args.local_steps, args.learning_rate, args.aggregation) == (5, 4, 1e-3, "fedavg")
    assert (args.server_optimizer, args.server_learning_rate) == ("sgd", 1.0)  # derived for fedavg, as the CLI's
    assert (model_args.lora_r, sorted(model_args.lora_target_modules)) == (4, ["q_proj", "v_proj"])
    assert data_args.reward_funcs == ["accuracy", "format"] and args.dirichlet_alpha == float("inf")
    assert args.reward_window == 2  # the app's, which no key overrides
    # A key the app would declare to set it: every field has one.
    args, _, _ = parse({**example_run_config(), "save-every-round": False, "client-timeout": 60})
    assert (args.save_every_round, args.client_timeout) == (False, 60)


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"num-roundz": 5}, r"Unknown run-config key `num-roundz`.*Did you mean `num-rounds`\?"),
        ({"num_rounds": 5}, r"Unknown run-config key `num_rounds`.*Did you mean `num-rounds`\?"),
        ({"resume-from-checkpoint": True}, r"Unknown run-config key `resume-from-checkpoint`"),
        ({"num-rounds": "five"}, r"run-config key `num-rounds`: invalid int value: 'five'"),
        ({"aggregation": "fedsgd"}, r"run-config key `aggregation`: invalid choice: 'fedsgd'"),
        ({"num-rounds": 0}, r"`num_rounds` \(run-config key `num-rounds`\) must be a positive integer, got 0"),
        ({"reward-window": 9}, r"`reward_window` \(run-config key `reward-window`\) .* must not exceed `local_steps`"),
        ({"num-rounds": 4, "num-server-rounds": 5}, r"`num-rounds` and `num-server-rounds` both set `num_rounds`"),
    ],
)
def test_a_bad_key_or_value_is_refused_by_its_key(run_config, message):
    with pytest.raises(ValueError, match=message):
        parse({"use-cpu": True, "bf16": False, "local-steps": 2, **run_config})


def test_num_clients_follows_the_federation_unless_set_and_then_must_match_it():
    assert parse(example_run_config(), federation_size=4)[0].num_clients == 4
    assert parse(example_run_config(**{"num-clients": 4}), federation_size=4)[0].num_clients == 4
    with pytest.raises(FederationSizeError, match=r"federation has 10 SuperNodes.*`num-clients` asks for 2 clients"):
        parse(example_run_config(**{"num-clients": 2}), federation_size=10)
    # Outside a simulation the run config decides (the app leaves num_clients to the federation: default 1).
    assert parse(example_run_config(**{"num-clients": 3}))[0].num_clients == 3


def test_a_yaml_num_clients_that_differs_from_the_federation_is_refused(tmp_path):
    yaml = tmp_path / "federation.yaml"
    yaml.write_text("num_clients: 2\n")
    run_config = {**example_run_config(), "config": str(yaml)}  # an app whose YAML base sets it
    assert parse(run_config, federation_size=2)[0].num_clients == 2
    with pytest.raises(FederationSizeError, match=r"has 10 SuperNodes.*`num_clients` in federation.yaml asks for 2"):
        parse(run_config, federation_size=10)


def test_a_taken_output_dir_is_refused_before_the_model_loads_with_run_config_advice(tmp_path, tiny_model_dir):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    run_config = example_run_config(**{"output-dir": str(tmp_path), "model-name-or-path": str(tiny_model_dir)})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with pytest.raises(FileExistsError, match=r'already holds another run \(metrics.jsonl\): set --run-config '
                       r'"overwrite-output-dir=true" .* --run-config "output-dir=\.\.\."'):
        build_strategy(context)
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_new_app_writes_a_ready_flower_app_and_refuses_a_folder_that_holds_anything(tmp_path, capsys):
    """`trl-federated new-app DIR` writes the example app's pyproject.toml, named after DIR: Flower's own check
    passes and imports its components, the packaged ServerApp and ClientApp. A folder that holds anything is refused
    in one line, untouched."""
    from flwr.clientapp import ClientApp
    from flwr.common.config import validate_config
    from flwr.serverapp import ServerApp
    from flwr.supercore.object_ref import load_app

    folder = tmp_path / "my app"
    assert cli_main(["new-app", str(folder)]) == 0
    assert f"flwr run {folder} --stream" in capsys.readouterr().out
    config = tomllib.loads((folder / "pyproject.toml").read_text())
    assert config["project"]["name"] == "my-app"
    assert validate_config(config, check_module=True, project_dir=folder)[:2] == (True, [])
    components = config["tool"]["flwr"]["app"]["components"]
    assert isinstance(load_app(components["serverapp"], ImportError, folder), ServerApp)
    assert isinstance(load_app(components["clientapp"], ImportError, folder), ClientApp)
    assert config["tool"]["flwr"]["app"]["config"] == example_run_config()  # the example's federation

    (folder / "pyproject.toml").write_text("mine")
    with pytest.raises(SystemExit) as refused:
        cli_main(["new-app", str(folder)])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and error.count("\n") == 1 and "is not an empty folder" in error
    assert [path.name for path in folder.iterdir()] == ["pyproject.toml"]
    assert (folder / "pyproject.toml").read_text() == "mine"


# A stand-in for Flower's CLI: `flwr run` accepts the run and streams its log, `flwr ls` reports RUN_STATUS; each
# call is appended to FLWR_CALLS.
FAKE_FLWR = """#!{python}
import json, os, sys
with open(os.environ["FLWR_CALLS"], "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "run":
    print("Successfully started run 7")
    print("INFO :      [ROUND 1/1]")
else:
    run = {{"run-id": "7", "status": os.environ["RUN_STATUS"], "status-details": "FederationSizeError: ..."}}
    print(json.dumps({{"success": True, "runs": [run]}}))
"""


@pytest.fixture
def fake_flwr(tmp_path, monkeypatch):
    """The calls made to a fake `flwr` first on PATH."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "flwr").write_text(FAKE_FLWR.format(python=sys.executable))
    (bin_dir / "flwr").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FLWR_CALLS", str(calls))
    return calls


@pytest.mark.parametrize(("status", "exit_status"), [("finished:completed", 0), ("finished:failed", 1)])
def test_flwr_run_exits_with_the_runs_status(fake_flwr, monkeypatch, capsys, status, exit_status):
    monkeypatch.setenv("RUN_STATUS", status)
    argv = [str(APP_DIR), "--stream", "--federation-config", "num-supernodes=3", "-c", "num-server-rounds=1"]
    assert flwr_run.main(argv) == exit_status
    assert fake_flwr.read_text().splitlines() == [" ".join(["run", *argv]), "ls --run-id 7 --format json"]
    output = capsys.readouterr()
    assert "[ROUND 1/1]" in output.out  # the run's log, passed through
    assert ("Run 7 is finished:failed: FederationSizeError" in output.err) == bool(exit_status)


def test_flwr_run_without_stream_leaves_the_run_to_flower(fake_flwr, monkeypatch):
    monkeypatch.setenv("RUN_STATUS", "finished:failed")
    assert flwr_run.main([str(APP_DIR)]) == 0  # the run goes on after `flwr run` returns: no status to wait for
    assert fake_flwr.read_text().splitlines() == [f"run {APP_DIR}"]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("num-server-round=1", r"`num-server-round` is not declared in .*pyproject.toml.*Did you mean "
                               r"`num-server-rounds`\?"),
        ("weight-decay=0.1", r"`weight-decay` is not declared .* It sets a field: declare it there "
                             r"\(`weight-decay = <value>`\)"),
    ],
)
def test_flwr_run_names_an_undeclared_key_before_flower_starts(fake_flwr, capsys, item, message):
    with pytest.raises(SystemExit) as exit_info:
        flwr_run.main([str(APP_DIR), "--stream", "--run-config", f"learning-rate=1e-4 {item}"])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not fake_flwr.exists()  # Flower never started
