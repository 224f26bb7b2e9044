"""A Flower run config as the arguments of `trl-federated run`: every field's key, the YAML base, refusals that name
the key, and `num_clients` against the federation's size."""

import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from trl_federated.flower.run_config import (  # noqa: E402
    ALIASES,
    FederationSizeError,
    federation_arguments,
    run_config_keys,
)

APP_DIR = Path(__file__).parents[1] / "examples" / "flower"
APP_KEYS = ("resume", "clients-file")
sys.path.insert(0, str(APP_DIR))
from fgrpo_app.server_app import build_strategy  # noqa: E402


def example_run_config(**overrides):
    """The example app's [tool.flwr.app.config], fused with overrides as Flower fuses `--run-config`."""
    config = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(overrides) <= set(config)  # Flower refuses any other key before the app starts
    return {**config, **overrides}


def parse(run_config, federation_size=None):
    return federation_arguments(run_config, APP_DIR, app_keys=APP_KEYS, federation_size=federation_size)


def test_the_example_lists_every_key_and_its_defaults_are_the_yaml():
    config = example_run_config()
    assert set(config) == {"config", *APP_KEYS, *ALIASES, *run_config_keys()}
    assert {"num-rounds", "local-steps", "learning-rate", "lora-r", "aggregation", "num-clients",
            "model-name-or-path", "reward-funcs", "seed"} <= set(config)
    args, model_args, data_args = parse(config)
    assert (args.num_rounds, args.local_steps, args.learning_rate, args.server_optimizer) == (3, 2, 2e-4, "adam")
    assert (model_args.lora_r, model_args.lora_dropout, data_args.benchmark_size) == (16, 0.0, 400)
    assert args.output_dir == "outputs/flower-fgrpo"


def test_run_config_keys_override_the_yaml_field_by_field():
    args, model_args, data_args = parse(example_run_config(**{
        "num-server-rounds": 5, "local-steps": 4, "learning-rate": 1e-3, "aggregation": "fedavg", "lora-r": 4,
        "lora-target-modules": "q_proj,v_proj", "reward-funcs": "accuracy,format", "dirichlet-alpha": "inf",
        "save-every-round": False, "client-timeout": 60,
    }))
    assert (args.num_rounds, args.local_steps, args.learning_rate, args.aggregation) == (5, 4, 1e-3, "fedavg")
    assert args.server_optimizer == "adam"  # the YAML's, which no key overrides
    assert (model_args.lora_r, sorted(model_args.lora_target_modules)) == (4, ["q_proj", "v_proj"])
    assert data_args.reward_funcs == ["accuracy", "format"] and args.dirichlet_alpha == float("inf")
    assert (args.save_every_round, args.client_timeout, args.reward_window) == (False, 60, 2)


def test_without_the_yaml_a_field_keeps_its_default():
    args, _, _ = parse({"config": "", "use-cpu": True, "bf16": False, "num-rounds": 2})
    assert (args.num_rounds, args.local_steps, args.aggregation) == (2, 10, "rpg")


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
        parse({"config": "config.yaml", **run_config})


def test_num_clients_follows_the_federation_unless_set_and_then_must_match_it():
    assert parse(example_run_config(), federation_size=4)[0].num_clients == 4
    assert parse(example_run_config(**{"num-clients": 4}), federation_size=4)[0].num_clients == 4
    with pytest.raises(FederationSizeError, match=r"federation has 10 SuperNodes.*`num-clients` asks for 2 clients"):
        parse(example_run_config(**{"num-clients": 2}), federation_size=10)
    # Outside a simulation the run config decides (the YAML leaves num_clients to the federation: default 1).
    assert parse(example_run_config(**{"num-clients": 3}))[0].num_clients == 3


def test_a_yaml_num_clients_that_differs_from_the_federation_is_refused(tmp_path):
    yaml = tmp_path / "federation.yaml"
    yaml.write_text((APP_DIR / "config.yaml").read_text() + "num_clients: 2\n")
    run_config = example_run_config(config=str(yaml))
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
